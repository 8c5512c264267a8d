package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// The SDPA graphs checked without a GPU: a fake cuDNN backend API
// (fakeCUDNN) takes the calls dnn_sdpa.go makes through the cudnnBackendLib
// function table, checks each attribute's type against the one cuDNN 9's
// cudnn_graph.h gives it and each descriptor's required attributes at
// finalize, hands out one engine configuration whose plan asks for a
// chosen workspace, and executes a plan by interpreting its operation
// graph in float64 over a fake device memory (fakeMem): the operands at
// the variant pack's addresses with the tensors' strides and dtypes,
// virtual tensors held densely. So sdpaForward and sdpaBackward run end to
// end on the CPU (plan, workspace split, variant pack, execution), and
// what they write is compared with the float64 reference of the ops the
// graphs stand for.
//
// The interpreter gives each operation the meaning the frontend's graphs
// give it: a pointwise operation broadcasts an input's size-1 axes; a
// matrix product over heads pairs output head h with operand head h/(H/Hk)
// when the operand has Hk < H heads (the frontend's einsum "b (hk g) s
// d", grouped-query attention); a reduction sums (or takes the maximum)
// over the axes where its output has size 1, and over groups of
// consecutive heads where the output has fewer; a reshape between shapes
// that differ by the last two axes is the transpose. What it cannot tell
// is whether cuDNN's engines take the graphs: that is the GPU tests'
// (TestCuDNNAttention, TestAttentionQKV).

// fakeAttr is one attribute as set: its type and the values decoded.
type fakeAttr struct {
	typ   int32
	ints  []int64 // INT64, DATA_TYPE, the enum types, HANDLE, VOID_PTR, BACKEND_DESCRIPTOR, BOOLEAN (0 or 1)
	float []float32
}

type fakeDesc struct {
	typ   int32
	attrs map[int32]fakeAttr
	final bool
	// Engine configurations and engines the heuristics filled, and a
	// plan's workspace.
	filled bool
}

// fakeCUDNN is the fake backend: descriptors by handle, the first protocol
// error it met (nil while all is well), the workspace each plan reports,
// and the device memory plans execute on.
type fakeCUDNN struct {
	t      *testing.T
	descs  map[uintptr]*fakeDesc
	next   uintptr
	err    error
	planWS int64
	mem    *fakeMem
	handle cudnnHandle
	runs   int
	dnn    *DNN // whose plans execute finds by their descriptor
}

// fakeAttrTypes is each attribute's type by descriptor type, as
// cudnn_graph.h of cuDNN 9 documents it: the only attributes the SDPA
// code may set.
var fakeAttrTypes = map[int32]map[int32]int32{
	cudnnBackendPointwiseDesc: {
		cudnnAttrPointwiseMode: cudnnTypePointwiseMode, cudnnAttrPointwiseMathPrec: cudnnTypeDataType, cudnnAttrPointwiseAxis: cudnnTypeInt64},
	cudnnBackendOpPointwiseDesc: {
		cudnnAttrOpPointwisePWDesc: cudnnTypeBackendDescriptor, cudnnAttrOpPointwiseXDesc: cudnnTypeBackendDescriptor,
		cudnnAttrOpPointwiseBDesc: cudnnTypeBackendDescriptor, cudnnAttrOpPointwiseYDesc: cudnnTypeBackendDescriptor,
		cudnnAttrOpPointwiseTDesc: cudnnTypeBackendDescriptor, cudnnAttrOpPointwiseAlpha1: cudnnTypeFloat, cudnnAttrOpPointwiseAlpha2: cudnnTypeFloat},
	cudnnBackendTensorDesc: {
		cudnnAttrTensorByteAlignment: cudnnTypeInt64, cudnnAttrTensorDataType: cudnnTypeDataType, cudnnAttrTensorDimensions: cudnnTypeInt64,
		cudnnAttrTensorStrides: cudnnTypeInt64, cudnnAttrTensorUniqueID: cudnnTypeInt64, cudnnAttrTensorIsVirtual: cudnnTypeBoolean,
		cudnnAttrTensorIsByValue: cudnnTypeBoolean},
	cudnnBackendMatmulDesc: {cudnnAttrMatmulCompType: cudnnTypeDataType},
	cudnnBackendOpMatmulDesc: {
		cudnnAttrOpMatmulADesc: cudnnTypeBackendDescriptor, cudnnAttrOpMatmulBDesc: cudnnTypeBackendDescriptor,
		cudnnAttrOpMatmulCDesc: cudnnTypeBackendDescriptor, cudnnAttrOpMatmulDesc: cudnnTypeBackendDescriptor},
	cudnnBackendReductionDesc: {cudnnAttrReductionOperator: cudnnTypeReductionOperator, cudnnAttrReductionCompType: cudnnTypeDataType},
	cudnnBackendOpReductionDesc: {
		cudnnAttrOpReductionXDesc: cudnnTypeBackendDescriptor, cudnnAttrOpReductionYDesc: cudnnTypeBackendDescriptor,
		cudnnAttrOpReductionDesc: cudnnTypeBackendDescriptor},
	cudnnBackendOpReshapeDesc:  {cudnnAttrOpReshapeXDesc: cudnnTypeBackendDescriptor, cudnnAttrOpReshapeYDesc: cudnnTypeBackendDescriptor},
	cudnnBackendOperationGraph: {cudnnAttrOperationGraphHandle: cudnnTypeHandle, cudnnAttrOperationGraphOps: cudnnTypeBackendDescriptor},
	cudnnBackendEngineHeurDesc: {cudnnAttrEngineHeurMode: cudnnTypeHeurMode, cudnnAttrEngineHeurOperationGraph: cudnnTypeBackendDescriptor},
	cudnnBackendExecutionPlanDesc: {
		cudnnAttrExecutionPlanHandle: cudnnTypeHandle, cudnnAttrExecutionPlanEngineConfig: cudnnTypeBackendDescriptor},
	cudnnBackendVariantPackDesc: {
		cudnnAttrVariantPackUniqueIDs: cudnnTypeInt64, cudnnAttrVariantPackDataPointers: cudnnTypeVoidPtr,
		cudnnAttrVariantPackWorkspace: cudnnTypeVoidPtr},
}

// fakeRequired is the attributes finalize wants set, by descriptor type.
var fakeRequired = map[int32][]int32{
	cudnnBackendPointwiseDesc:   {cudnnAttrPointwiseMode, cudnnAttrPointwiseMathPrec},
	cudnnBackendOpPointwiseDesc: {cudnnAttrOpPointwisePWDesc, cudnnAttrOpPointwiseXDesc, cudnnAttrOpPointwiseYDesc},
	cudnnBackendTensorDesc: {cudnnAttrTensorByteAlignment, cudnnAttrTensorDataType, cudnnAttrTensorDimensions,
		cudnnAttrTensorStrides, cudnnAttrTensorUniqueID},
	cudnnBackendMatmulDesc:        {cudnnAttrMatmulCompType},
	cudnnBackendOpMatmulDesc:      {cudnnAttrOpMatmulADesc, cudnnAttrOpMatmulBDesc, cudnnAttrOpMatmulCDesc, cudnnAttrOpMatmulDesc},
	cudnnBackendReductionDesc:     {cudnnAttrReductionOperator, cudnnAttrReductionCompType},
	cudnnBackendOpReductionDesc:   {cudnnAttrOpReductionXDesc, cudnnAttrOpReductionYDesc, cudnnAttrOpReductionDesc},
	cudnnBackendOpReshapeDesc:     {cudnnAttrOpReshapeXDesc, cudnnAttrOpReshapeYDesc},
	cudnnBackendOperationGraph:    {cudnnAttrOperationGraphHandle, cudnnAttrOperationGraphOps},
	cudnnBackendEngineHeurDesc:    {cudnnAttrEngineHeurMode, cudnnAttrEngineHeurOperationGraph},
	cudnnBackendExecutionPlanDesc: {cudnnAttrExecutionPlanHandle, cudnnAttrExecutionPlanEngineConfig},
	cudnnBackendVariantPackDesc:   {cudnnAttrVariantPackUniqueIDs, cudnnAttrVariantPackDataPointers, cudnnAttrVariantPackWorkspace},
}

// fakeRefTypes is the descriptor type each BACKEND_DESCRIPTOR attribute
// must name.
var fakeRefTypes = map[int32]int32{
	cudnnAttrOpPointwisePWDesc: cudnnBackendPointwiseDesc, cudnnAttrOpPointwiseXDesc: cudnnBackendTensorDesc,
	cudnnAttrOpPointwiseBDesc: cudnnBackendTensorDesc, cudnnAttrOpPointwiseYDesc: cudnnBackendTensorDesc,
	cudnnAttrOpPointwiseTDesc: cudnnBackendTensorDesc,
	cudnnAttrOpMatmulADesc:    cudnnBackendTensorDesc, cudnnAttrOpMatmulBDesc: cudnnBackendTensorDesc,
	cudnnAttrOpMatmulCDesc: cudnnBackendTensorDesc, cudnnAttrOpMatmulDesc: cudnnBackendMatmulDesc,
	cudnnAttrOpReductionXDesc: cudnnBackendTensorDesc, cudnnAttrOpReductionYDesc: cudnnBackendTensorDesc,
	cudnnAttrOpReductionDesc: cudnnBackendReductionDesc,
	cudnnAttrOpReshapeXDesc:  cudnnBackendTensorDesc, cudnnAttrOpReshapeYDesc: cudnnBackendTensorDesc,
	cudnnAttrEngineHeurOperationGraph: cudnnBackendOperationGraph, cudnnAttrExecutionPlanEngineConfig: cudnnBackendEngineCfgDesc,
}

// fail records the first protocol error and returns a bad-parameter status.
func (f *fakeCUDNN) fail(format string, args ...any) cudnnStatus {
	if f.err == nil {
		f.err = fmt.Errorf(format, args...)
	}
	return 2000 // CUDNN_STATUS_BAD_PARAM
}

func newFakeCUDNN(t *testing.T, planWS int64) (*fakeCUDNN, *DNN) {
	f := &fakeCUDNN{t: t, descs: map[uintptr]*fakeDesc{}, next: 0x1000, planWS: planWS, mem: &fakeMem{next: 1 << 40}, handle: 0xcafe}
	be := &cudnnBackendLib{
		cudnnBackendCreateDescriptor:  f.create,
		cudnnBackendDestroyDescriptor: func(d uintptr) cudnnStatus { delete(f.descs, d); return 0 },
		cudnnBackendFinalize:          f.finalize,
		cudnnBackendSetAttribute:      f.set,
		cudnnBackendGetAttribute:      f.get,
		cudnnBackendExecute:           f.execute,
	}
	lib := &cudnnLib{backend: be, version: 91400, cudnnGetErrorString: func(cudnnStatus) *byte { return nil }}
	n := &DNN{lib: lib, h: f.handle, sdpaPlans: map[sdpaKey]*sdpaPlan{}, sdpaFallbacks: map[string]int{}}
	f.dnn = n
	return f, n
}

func (f *fakeCUDNN) create(t int32, d *uintptr) cudnnStatus {
	if _, ok := fakeAttrTypes[t]; !ok && t != cudnnBackendEngineCfgDesc && t != cudnnBackendEngineDesc {
		return f.fail("create: descriptor type %d is none the SDPA code uses", t)
	}
	f.next += 16
	f.descs[f.next] = &fakeDesc{typ: t, attrs: map[int32]fakeAttr{}}
	*d = f.next
	return 0
}

func (f *fakeCUDNN) set(d uintptr, name, typ int32, count int64, p unsafe.Pointer) cudnnStatus {
	desc := f.descs[d]
	switch {
	case desc == nil:
		return f.fail("set attribute %d on unknown descriptor %#x", name, d)
	case desc.final:
		return f.fail("set attribute %d on finalized descriptor type %d", name, desc.typ)
	case count <= 0 || p == nil:
		return f.fail("set attribute %d: %d elements at %v", name, count, p)
	}
	want, ok := fakeAttrTypes[desc.typ][name]
	if !ok {
		return f.fail("attribute %d does not belong to descriptor type %d", name, desc.typ)
	}
	if typ != want {
		return f.fail("attribute %d of descriptor type %d set as type %d, cuDNN's type is %d", name, desc.typ, typ, want)
	}
	a := fakeAttr{typ: typ}
	for i := range count {
		switch typ {
		case cudnnTypeInt64:
			a.ints = append(a.ints, *(*int64)(unsafe.Add(p, 8*i)))
		case cudnnTypeDataType, cudnnTypeHeurMode, cudnnTypePointwiseMode, cudnnTypeReductionOperator:
			a.ints = append(a.ints, int64(*(*int32)(unsafe.Add(p, 4*i))))
		case cudnnTypeBoolean:
			b := *(*byte)(unsafe.Add(p, i))
			if b > 1 {
				return f.fail("attribute %d: boolean byte %d", name, b)
			}
			a.ints = append(a.ints, int64(b))
		case cudnnTypeFloat:
			a.float = append(a.float, *(*float32)(unsafe.Add(p, 4*i)))
		case cudnnTypeHandle, cudnnTypeVoidPtr, cudnnTypeBackendDescriptor:
			a.ints = append(a.ints, int64(*(*uintptr)(unsafe.Add(p, 8*i))))
		default:
			return f.fail("attribute %d: type %d", name, typ)
		}
	}
	if typ == cudnnTypeBackendDescriptor {
		for _, h := range a.ints {
			ref := f.descs[uintptr(h)]
			if ref == nil || !ref.final {
				return f.fail("attribute %d of descriptor type %d names descriptor %#x that is not finalized", name, desc.typ, h)
			}
			if w, ok := fakeRefTypes[name]; ok && ref.typ != w {
				return f.fail("attribute %d names a descriptor of type %d, want %d", name, ref.typ, w)
			}
			if name == cudnnAttrOperationGraphOps && ref.typ != cudnnBackendOpPointwiseDesc && ref.typ != cudnnBackendOpMatmulDesc &&
				ref.typ != cudnnBackendOpReductionDesc && ref.typ != cudnnBackendOpReshapeDesc {
				return f.fail("operation graph op of descriptor type %d", ref.typ)
			}
		}
	}
	if typ == cudnnTypeHandle && cudnnHandle(a.ints[0]) != f.handle {
		return f.fail("attribute %d: handle %#x", name, a.ints[0])
	}
	desc.attrs[name] = a
	return 0
}

func (f *fakeCUDNN) finalize(d uintptr) cudnnStatus {
	desc := f.descs[d]
	if desc == nil || desc.final {
		return f.fail("finalize of unknown or finalized descriptor %#x", d)
	}
	for _, name := range fakeRequired[desc.typ] {
		if _, ok := desc.attrs[name]; !ok {
			return f.fail("finalize of descriptor type %d without attribute %d", desc.typ, name)
		}
	}
	switch desc.typ {
	case cudnnBackendTensorDesc:
		dims, st := desc.attrs[cudnnAttrTensorDimensions].ints, desc.attrs[cudnnAttrTensorStrides].ints
		if len(dims) != len(st) || slices.ContainsFunc(dims, func(x int64) bool { return x < 1 }) ||
			slices.ContainsFunc(st, func(x int64) bool { return x < 1 }) {
			return f.fail("tensor dims %v, strides %v", dims, st)
		}
		if desc.attrs[cudnnAttrTensorByteAlignment].ints[0] != 16 {
			return f.fail("tensor alignment %v", desc.attrs[cudnnAttrTensorByteAlignment].ints)
		}
	case cudnnBackendExecutionPlanDesc:
		cfg := f.descs[uintptr(desc.attrs[cudnnAttrExecutionPlanEngineConfig].ints[0])]
		if !cfg.filled {
			return f.fail("execution plan of an engine configuration the heuristics did not fill")
		}
	case cudnnBackendEngineCfgDesc, cudnnBackendEngineDesc:
		return f.fail("finalize of descriptor type %d, which the heuristics fill", desc.typ)
	}
	desc.final = true
	return 0
}

func (f *fakeCUDNN) get(d uintptr, name, typ int32, requested int64, count *int64, p unsafe.Pointer) cudnnStatus {
	desc := f.descs[d]
	if desc == nil {
		return f.fail("get attribute %d of unknown descriptor", name)
	}
	switch {
	case desc.typ == cudnnBackendEngineHeurDesc && name == cudnnAttrEngineHeurResults && typ == cudnnTypeBackendDescriptor:
		if !desc.final {
			return f.fail("heuristics results before finalize")
		}
		*count = 1
		if requested > 0 {
			cfg := f.descs[*(*uintptr)(p)]
			if cfg == nil || cfg.typ != cudnnBackendEngineCfgDesc {
				return f.fail("heuristics results into a descriptor that is no engine configuration")
			}
			cfg.filled, cfg.final = true, true
		}
	case desc.typ == cudnnBackendExecutionPlanDesc && name == cudnnAttrExecutionPlanWorkspaceSize && typ == cudnnTypeInt64 && requested == 1:
		if !desc.final {
			return f.fail("plan workspace before finalize")
		}
		*count, *(*int64)(p) = 1, f.planWS
	case desc.typ == cudnnBackendEngineCfgDesc && name == cudnnAttrEngineCfgEngine && typ == cudnnTypeBackendDescriptor && requested == 1:
		eng := f.descs[*(*uintptr)(p)]
		if eng == nil || eng.typ != cudnnBackendEngineDesc {
			return f.fail("engine configuration's engine into a descriptor that is no engine")
		}
		eng.filled = true
		*count = 1
	case desc.typ == cudnnBackendEngineDesc && name == cudnnAttrEngineGlobalIndex && typ == cudnnTypeInt64 && requested == 1:
		*count, *(*int64)(p) = 1, 2
	default:
		return f.fail("get attribute %d of descriptor type %d as type %d", name, desc.typ, typ)
	}
	return 0
}

// fakeTensor is a tensor descriptor's attributes.
type fakeTensor struct {
	uid              int64
	dt               int32
	dims, strides    []int64
	virtual, byValue bool
}

func (f *fakeCUDNN) tensorOf(h int64) fakeTensor {
	a := f.descs[uintptr(h)].attrs
	return fakeTensor{uid: a[cudnnAttrTensorUniqueID].ints[0], dt: int32(a[cudnnAttrTensorDataType].ints[0]),
		dims: a[cudnnAttrTensorDimensions].ints, strides: a[cudnnAttrTensorStrides].ints,
		virtual: a[cudnnAttrTensorIsVirtual].ints[0] == 1, byValue: a[cudnnAttrTensorIsByValue].ints[0] == 1}
}

// execute interprets plan's operation graph over the variant pack. The
// plan's graph and by-value scalars are read from the sdpaPlan that holds
// the plan descriptor (the scalars by value, never through the pack's
// host addresses, which are only compared).
func (f *fakeCUDNN) execute(h cudnnHandle, plan, pack uintptr) cudnnStatus {
	pl, vp := f.descs[plan], f.descs[pack]
	if h != f.handle || pl == nil || !pl.final || vp == nil || !vp.final || pl.typ != cudnnBackendExecutionPlanDesc || vp.typ != cudnnBackendVariantPackDesc {
		return f.fail("execute: handle, plan or variant pack")
	}
	var sp *sdpaPlan
	for _, p := range f.dnn.sdpaPlans {
		if p.plan == plan {
			sp = p
		}
	}
	if sp == nil {
		return f.fail("execute: plan %#x is no sdpaPlan's", plan)
	}
	uids, ptrs := vp.attrs[cudnnAttrVariantPackUniqueIDs].ints, vp.attrs[cudnnAttrVariantPackDataPointers].ints
	if len(uids) != len(ptrs) {
		return f.fail("variant pack: %d unique ids, %d pointers", len(uids), len(ptrs))
	}
	in := &fakeInterp{f: f, addr: map[int64]uintptr{}, vals: map[int64][]float64{}, scalars: map[int64]float64{}}
	for i, u := range uids {
		if _, dup := in.addr[u]; dup {
			return f.fail("variant pack names uid %d twice", u)
		}
		in.addr[u] = uintptr(ptrs[i])
	}
	for _, u := range sp.bg.byVal {
		i := u - sdpaScale
		if i < 0 || i >= int64(len(sp.scalars)) || in.addr[u] != uintptr(unsafe.Pointer(&sp.scalars[i])) {
			return f.fail("variant pack: by-value uid %d at %#x, not its scalar's address", u, in.addr[u])
		}
		in.scalars[u] = float64(sp.scalars[i])
	}
	// Every non-virtual tensor the graph reads or writes is in the pack,
	// and the pack names nothing else.
	used := map[int64]bool{}
	for _, op := range sp.bg.ops {
		for _, t := range f.opTensors(f.descs[op]) {
			if !t.virtual {
				used[t.uid] = true
			}
		}
	}
	for u := range used {
		if _, ok := in.addr[u]; !ok {
			return f.fail("variant pack lacks uid %d", u)
		}
	}
	for u := range in.addr {
		if !used[u] {
			return f.fail("variant pack names uid %d, which no operation reads or writes", u)
		}
	}
	for _, op := range sp.bg.ops {
		if err := in.run(f.descs[op]); err != nil {
			return f.fail("execute: %v", err)
		}
	}
	f.runs++
	return 0
}

// opTensors is an operation's tensors, inputs first, output last.
func (f *fakeCUDNN) opTensors(op *fakeDesc) []fakeTensor {
	var names []int32
	switch op.typ {
	case cudnnBackendOpPointwiseDesc:
		names = []int32{cudnnAttrOpPointwiseXDesc, cudnnAttrOpPointwiseBDesc, cudnnAttrOpPointwiseTDesc, cudnnAttrOpPointwiseYDesc}
	case cudnnBackendOpMatmulDesc:
		names = []int32{cudnnAttrOpMatmulADesc, cudnnAttrOpMatmulBDesc, cudnnAttrOpMatmulCDesc}
	case cudnnBackendOpReductionDesc:
		names = []int32{cudnnAttrOpReductionXDesc, cudnnAttrOpReductionYDesc}
	case cudnnBackendOpReshapeDesc:
		names = []int32{cudnnAttrOpReshapeXDesc, cudnnAttrOpReshapeYDesc}
	}
	var out []fakeTensor
	for _, n := range names {
		if a, ok := op.attrs[n]; ok {
			out = append(out, f.tensorOf(a.ints[0]))
		}
	}
	return out
}

// fakeMem is device memory: regions of elements of one byte size each,
// held as float64.
type fakeMem struct {
	regions []fakeRegion
	next    uintptr
}

type fakeRegion struct {
	base uintptr
	size int // bytes per element
	data []float64
}

// alloc makes a region of n elements of size bytes, 256-byte aligned,
// filled with NaN (what no operation writes stays NaN).
func (m *fakeMem) alloc(n, size int) alloc.Ptr {
	r := fakeRegion{base: m.next, size: size, data: make([]float64, n)}
	for i := range r.data {
		r.data[i] = math.NaN()
	}
	m.regions = append(m.regions, r)
	m.next += uintptr(align256(int64(n*size))) + 4096
	return alloc.Ptr(r.base)
}

// at is the element at byte address a, read as an element of size bytes.
func (m *fakeMem) at(a uintptr, size int) (*float64, error) {
	for _, r := range m.regions {
		if a >= r.base && a < r.base+uintptr(len(r.data)*r.size) {
			if r.size != size || (a-r.base)%uintptr(size) != 0 {
				return nil, fmt.Errorf("address %#x: an element of %d bytes in a region of %d-byte elements", a, size, r.size)
			}
			return &r.data[(a-r.base)/uintptr(size)], nil
		}
	}
	return nil, fmt.Errorf("address %#x is in no region", a)
}

// region is the data of the region at p.
func (m *fakeMem) region(p alloc.Ptr) []float64 {
	for _, r := range m.regions {
		if r.base == uintptr(p) {
			return r.data
		}
	}
	return nil
}

// fakeInterp runs one execution: the pack's addresses by uid and the
// virtual tensors' values (dense over their dims), by uid.
type fakeInterp struct {
	f       *fakeCUDNN
	addr    map[int64]uintptr
	vals    map[int64][]float64
	scalars map[int64]float64 // by-value tensors' values
}

func dtBytes(dt int32) int {
	switch dt {
	case cudnnDataFloat, cudnnDataInt32:
		return 4
	case cudnnDataHalf, cudnnDataBFloat16:
		return 2
	case cudnnDataBoolean:
		return 1
	}
	return 0
}

func denseIndex(idx, dims []int64) int64 {
	var n int64
	for i, x := range idx {
		n = n*dims[i] + x
	}
	return n
}

func (in *fakeInterp) read(t fakeTensor, idx []int64) (float64, error) {
	switch {
	case t.byValue:
		v, ok := in.scalars[t.uid]
		if !ok || t.dt != cudnnDataFloat {
			return 0, fmt.Errorf("by-value tensor %d", t.uid)
		}
		return v, nil
	case t.virtual:
		v, ok := in.vals[t.uid]
		if !ok {
			return 0, fmt.Errorf("virtual tensor %d read before it is written", t.uid)
		}
		return v[denseIndex(idx, t.dims)], nil
	}
	p, err := in.elem(t, idx)
	if err != nil {
		return 0, err
	}
	if math.IsNaN(*p) {
		return 0, fmt.Errorf("tensor %d reads an element nothing wrote (index %v)", t.uid, idx)
	}
	return *p, nil
}

func (in *fakeInterp) elem(t fakeTensor, idx []int64) (*float64, error) {
	base, ok := in.addr[t.uid]
	if !ok {
		return nil, fmt.Errorf("tensor %d has no address", t.uid)
	}
	var off int64
	for i, x := range idx {
		off += x * t.strides[i]
	}
	return in.f.mem.at(base+uintptr(off*int64(dtBytes(t.dt))), dtBytes(t.dt))
}

// output is a writer of t's elements by index.
func (in *fakeInterp) output(t fakeTensor) (func(idx []int64, v float64) error, error) {
	if t.byValue {
		return nil, fmt.Errorf("an operation writes by-value tensor %d", t.uid)
	}
	if t.virtual {
		if _, ok := in.vals[t.uid]; ok {
			return nil, fmt.Errorf("virtual tensor %d written twice", t.uid)
		}
		v := make([]float64, numel64(t.dims))
		in.vals[t.uid] = v
		return func(idx []int64, x float64) error { v[denseIndex(idx, t.dims)] = x; return nil }, nil
	}
	return func(idx []int64, x float64) error {
		p, err := in.elem(t, idx)
		if err != nil {
			return err
		}
		*p = x
		return nil
	}, nil
}

func numel64(dims []int64) int64 {
	n := int64(1)
	for _, d := range dims {
		n *= d
	}
	return n
}

// each calls fn with every index of dims, in row-major order.
func each(dims []int64, fn func(idx []int64) error) error {
	idx := make([]int64, len(dims))
	for n := numel64(dims); n > 0; n-- {
		if err := fn(idx); err != nil {
			return err
		}
		for i := len(idx) - 1; i >= 0; i-- {
			if idx[i]++; idx[i] < dims[i] {
				break
			}
			idx[i] = 0
		}
	}
	return nil
}

// bcast maps output index idx (over out's dims) to an operand of dims x:
// the same index, 0 on the operand's size-1 axes, and on a head-like axis
// where the operand has a divisor of the output's size, the group's
// (grouped is whether that is allowed).
func bcast(idx, out, x []int64, grouped bool) ([]int64, error) {
	if len(x) != len(out) {
		return nil, fmt.Errorf("ranks differ: %v against %v", x, out)
	}
	r := make([]int64, len(idx))
	for i := range idx {
		switch {
		case x[i] == out[i]:
			r[i] = idx[i]
		case x[i] == 1:
			r[i] = 0
		case grouped && out[i]%x[i] == 0:
			r[i] = idx[i] / (out[i] / x[i])
		default:
			return nil, fmt.Errorf("operand %v does not broadcast to %v", x, out)
		}
	}
	return r, nil
}

func (in *fakeInterp) run(op *fakeDesc) error {
	ts := in.f.opTensors(op)
	y := ts[len(ts)-1]
	xs := ts[:len(ts)-1]
	put, err := in.output(y)
	if err != nil {
		return err
	}
	switch op.typ {
	case cudnnBackendOpPointwiseDesc:
		pw := in.f.descs[uintptr(op.attrs[cudnnAttrOpPointwisePWDesc].ints[0])].attrs
		mode := int32(pw[cudnnAttrPointwiseMode].ints[0])
		axis := int64(-1)
		if a, ok := pw[cudnnAttrPointwiseAxis]; ok {
			axis = a.ints[0]
		}
		arity := map[int32]int{cudnnPointwiseAdd: 2, cudnnPointwiseMul: 2, cudnnPointwiseDiv: 2, cudnnPointwiseSub: 2, cudnnPointwiseExp: 1,
			cudnnPointwiseLog: 1, cudnnPointwiseIdentity: 1, cudnnPointwiseCmpGE: 2, cudnnPointwiseGenIndex: 1, cudnnPointwiseBinarySelect: 3}[mode]
		if arity == 0 || arity != len(xs) {
			return fmt.Errorf("pointwise mode %d with %d inputs", mode, len(xs))
		}
		return each(y.dims, func(idx []int64) error {
			var v [3]float64
			for i, x := range xs {
				if mode == cudnnPointwiseGenIndex {
					break
				}
				xi, err := bcast(idx, y.dims, x.dims, false)
				if err != nil {
					return fmt.Errorf("pointwise %d: %w", mode, err)
				}
				if v[i], err = in.read(x, xi); err != nil {
					return err
				}
			}
			var r float64
			switch mode {
			case cudnnPointwiseAdd:
				r = v[0] + v[1]
			case cudnnPointwiseMul:
				r = v[0] * v[1]
			case cudnnPointwiseDiv:
				r = v[0] / v[1]
			case cudnnPointwiseSub:
				r = v[0] - v[1]
			case cudnnPointwiseExp:
				r = math.Exp(v[0])
			case cudnnPointwiseLog:
				r = math.Log(v[0])
			case cudnnPointwiseIdentity:
				r = v[0]
			case cudnnPointwiseCmpGE:
				r = map[bool]float64{true: 1, false: 0}[v[0] >= v[1]]
			case cudnnPointwiseGenIndex:
				if axis < 0 || axis >= int64(len(idx)) || !slices.Equal(xs[0].dims, y.dims) {
					return fmt.Errorf("gen_index axis %d over %v", axis, xs[0].dims)
				}
				r = float64(idx[axis])
			case cudnnPointwiseBinarySelect:
				r = v[1]
				if v[2] != 0 {
					r = v[0]
				}
			}
			return put(idx, r)
		})
	case cudnnBackendOpMatmulDesc:
		a, b := xs[0], xs[1]
		n := len(y.dims)
		if len(a.dims) != n || len(b.dims) != n || a.dims[n-2] != y.dims[n-2] || b.dims[n-1] != y.dims[n-1] || a.dims[n-1] != b.dims[n-2] {
			return fmt.Errorf("matmul %v · %v → %v", a.dims, b.dims, y.dims)
		}
		k := a.dims[n-1]
		return each(y.dims, func(idx []int64) error {
			ai, err := bcast(idx[:n-2], y.dims[:n-2], a.dims[:n-2], true)
			if err != nil {
				return fmt.Errorf("matmul a: %w", err)
			}
			bi, err := bcast(idx[:n-2], y.dims[:n-2], b.dims[:n-2], true)
			if err != nil {
				return fmt.Errorf("matmul b: %w", err)
			}
			var sum float64
			for j := range k {
				x, err := in.read(a, append(slices.Clone(ai), idx[n-2], j))
				if err != nil {
					return err
				}
				z, err := in.read(b, append(slices.Clone(bi), j, idx[n-1]))
				if err != nil {
					return err
				}
				sum += x * z
			}
			return put(idx, sum)
		})
	case cudnnBackendOpReductionDesc:
		r := in.f.descs[uintptr(op.attrs[cudnnAttrOpReductionDesc].ints[0])].attrs
		mode := r[cudnnAttrReductionOperator].ints[0]
		if mode != cudnnReduceAdd && mode != cudnnReduceMax {
			return fmt.Errorf("reduction operator %d", mode)
		}
		x := xs[0]
		acc := make([]float64, numel64(y.dims))
		for i := range acc {
			acc[i] = map[bool]float64{true: 0, false: math.Inf(-1)}[mode == cudnnReduceAdd]
		}
		if err := each(x.dims, func(idx []int64) error {
			// The output index of x's element: the inverse of bcast.
			yi := make([]int64, len(idx))
			for i := range idx {
				switch {
				case y.dims[i] == x.dims[i]:
					yi[i] = idx[i]
				case y.dims[i] == 1:
				case x.dims[i]%y.dims[i] == 0:
					yi[i] = idx[i] / (x.dims[i] / y.dims[i])
				default:
					return fmt.Errorf("reduction %v → %v", x.dims, y.dims)
				}
			}
			v, err := in.read(x, idx)
			if err != nil {
				return err
			}
			j := denseIndex(yi, y.dims)
			if mode == cudnnReduceAdd {
				acc[j] += v
			} else {
				acc[j] = math.Max(acc[j], v)
			}
			return nil
		}); err != nil {
			return err
		}
		return each(y.dims, func(idx []int64) error { return put(idx, acc[denseIndex(idx, y.dims)]) })
	case cudnnBackendOpReshapeDesc:
		x, n := xs[0], len(y.dims)
		swapped := slices.Clone(x.dims)
		swapped[n-1], swapped[n-2] = swapped[n-2], swapped[n-1]
		if !slices.Equal(y.dims, swapped) {
			return fmt.Errorf("reshape %v → %v is no transpose of the last two axes", x.dims, y.dims)
		}
		return each(y.dims, func(idx []int64) error {
			xi := slices.Clone(idx)
			xi[n-1], xi[n-2] = xi[n-2], xi[n-1]
			v, err := in.read(x, xi)
			if err != nil {
				return err
			}
			return put(idx, v)
		})
	}
	return fmt.Errorf("operation of descriptor type %d", op.typ)
}

// sdpaFakeCase is one problem for TestSDPAGraphsOnFakeCUDNN.
type sdpaFakeCase struct {
	b, h, hkv, t, d int
	causal, packed  bool
}

func (c sdpaFakeCase) String() string {
	return fmt.Sprintf("B%d_H%d_Hkv%d_T%d_d%d_causal%v_packed%v", c.b, c.h, c.hkv, c.t, c.d, c.causal, c.packed)
}

// TestSDPAGraphsOnFakeCUDNN runs sdpaForward and sdpaBackward, unpacked
// and packed (attention_qkv's layout), with as many key/value heads as
// query heads, grouped (GQA) and one (MQA), causal or not, on the fake
// backend, and holds o, the log-sum-exp, dq and dk|dv (unpacked) or d qkv
// (packed) to the float64 reference of attention, attention_lse,
// attention_grad_q and attention_grad_kv (or attention_qkv's three ops)
// on the same values: within 1e-9 of each output's largest magnitude (the
// interpreter computes in float64 without the 16-bit roundings, so only
// the order of sums differs). Every element of the outputs is written (the
// fake memory starts as NaN), the variant packs name exactly the tensors
// the graphs use, and every attribute has cuDNN's type.
func TestSDPAGraphsOnFakeCUDNN(t *testing.T) {
	var cases []sdpaFakeCase
	for _, packed := range []bool{false, true} {
		for _, causal := range []bool{false, true} {
			for _, hs := range [][2]int{{2, 2}, {4, 2}, {3, 1}} {
				cases = append(cases, sdpaFakeCase{b: 2, h: hs[0], hkv: hs[1], t: 5, d: 64, causal: causal, packed: packed})
			}
		}
	}
	cases = append(cases, sdpaFakeCase{b: 1, h: 4, hkv: 1, t: 7, d: 128, causal: true, packed: true},
		sdpaFakeCase{b: 1, h: 6, hkv: 2, t: 6, d: 128, packed: false})
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) { fakeSDPACase(t, c) })
	}
}

func fakeSDPACase(t *testing.T, c sdpaFakeCase) {
	const planWS = 256
	f, n := newFakeCUDNN(t, planWS)
	rng := rand.New(rand.NewPCG(uint64(c.h*100+c.hkv), uint64(c.t)))
	dt := graph.BFloat16
	scale := float32(1 / math.Sqrt(float64(c.d)))
	sh := attnShape{b: c.b, h: c.h, hkv: c.hkv, t: c.t, s: c.t, d: c.d, scale: scale, causal: c.causal}
	x := sdpaDims{b: int64(c.b), h: int64(c.h), hkv: int64(c.hkv), t: int64(c.t), s: int64(c.t), d: int64(c.d)}

	// The reference graph and its inputs' values (float32, as the
	// executors' host data).
	g := graph.New()
	add := func(nd graph.Node) int {
		id, err := g.Append(nd)
		require.NoError(t, err)
		return id
	}
	input := func(shape ...int) (int, []float32) {
		d := make([]float32, graph.Numel(shape))
		for i := range d {
			d[i] = float32(2*rng.Float64() - 1)
		}
		return add(graph.Node{Op: graph.OpInput, Value: tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d)),
			Type: graph.Type{Shape: shape, DType: graph.Float32, BatchAxis: 0, PerSample: 1}}), d
	}
	load := func(p alloc.Ptr, d []float32) {
		r := f.mem.region(p)
		require.Len(t, r, len(d))
		for i, v := range d {
			r[i] = float64(v)
		}
	}
	fwdWS, bwdWS := sdpaFwdBytes(x), sdpaBwdBytes(x)
	ws := f.mem.alloc(int(max(fwdWS, bwdWS)/4), 4)
	lse := f.mem.alloc(c.b*c.h*c.t, 4)
	var ids []int
	var outs []alloc.Ptr // o, lse, then dq and dk|dv, or d qkv
	if c.packed {
		s := graph.QKVShape{B: c.b, H: c.h, Hkv: c.hkv, T: c.t, D: c.d}
		a := graph.Attrs{Groups: c.h, KVHeads: c.hkv, Causal: c.causal, Scalar: float64(scale)}
		qkvID, qkvData := input(c.b, c.t, s.Pitch())
		gID, gData := input(c.b, c.t, s.C())
		o := add(graph.Node{Op: graph.OpAttentionQKV, Inputs: []int{qkvID}, Attrs: a})
		l := add(graph.Node{Op: graph.OpAttentionQKVLSE, Inputs: []int{qkvID}, Attrs: a})
		d := add(graph.Node{Op: graph.OpAttentionQKVGrad, Inputs: []int{gID, qkvID, o, l}, Attrs: a})
		ids = []int{o, l, d}
		qkv, gp := f.mem.alloc(len(qkvData), 2), f.mem.alloc(len(gData), 2)
		load(qkv, qkvData)
		load(gp, gData)
		op, dqkv := f.mem.alloc(len(gData), 2), f.mem.alloc(len(qkvData), 2)
		q, kk, v := qkvParts(qkv, dt, s)
		done, err := n.sdpaForward(dt, sh, false, true, q, kk, v, op, lse, ws, fwdWS)
		require.NoError(t, err)
		require.NoError(t, f.err)
		require.True(t, done, "%v", n.AttnStats())
		dq, dk, dv := qkvParts(dqkv, dt, s)
		done, err = n.sdpaBackward(dt, sh, false, true, gp, q, kk, v, op, lse, dq, dk, dv, ws, bwdWS)
		require.NoError(t, err)
		require.NoError(t, f.err)
		require.True(t, done, "%v", n.AttnStats())
		outs = []alloc.Ptr{op, lse, dqkv}
	} else {
		a := graph.Attrs{Causal: c.causal, Scalar: float64(scale)}
		qID, qData := input(c.b, c.h, c.t, c.d)
		kID, kData := input(c.b, c.hkv, c.t, c.d)
		vID, vData := input(c.b, c.hkv, c.t, c.d)
		gID, gData := input(c.b, c.h, c.t, c.d)
		o := add(graph.Node{Op: graph.OpAttention, Inputs: []int{qID, kID, vID}, Attrs: a})
		l := add(graph.Node{Op: graph.OpAttentionLSE, Inputs: []int{qID, kID}, Attrs: a})
		args := []int{gID, qID, kID, vID, o, l}
		dq := add(graph.Node{Op: graph.OpAttentionGradQ, Inputs: args, Attrs: a})
		dkv := add(graph.Node{Op: graph.OpAttentionGradKV, Inputs: args, Attrs: a})
		ids = []int{o, l, dq, dkv}
		q, kk, v, gp := f.mem.alloc(len(qData), 2), f.mem.alloc(len(kData), 2), f.mem.alloc(len(vData), 2), f.mem.alloc(len(gData), 2)
		load(q, qData)
		load(kk, kData)
		load(v, vData)
		load(gp, gData)
		op, dqp, dkvp := f.mem.alloc(len(qData), 2), f.mem.alloc(len(qData), 2), f.mem.alloc(2*len(kData), 2)
		done, err := n.sdpaForward(dt, sh, false, false, q, kk, v, op, lse, ws, fwdWS)
		require.NoError(t, err)
		require.NoError(t, f.err)
		require.True(t, done, "%v", n.AttnStats())
		done, err = n.sdpaBackward(dt, sh, false, false, gp, q, kk, v, op, lse, dqp, dkvp, dkvp+alloc.Ptr(c.d*dt.Size()), ws, bwdWS)
		require.NoError(t, err)
		require.NoError(t, f.err)
		require.True(t, done, "%v", n.AttnStats())
		outs = []alloc.Ptr{op, lse, dqp, dkvp}
	}
	require.Equal(t, 2, f.runs)
	st := n.AttnStats()
	require.Equal(t, 1, st.Forward)
	require.Equal(t, 1, st.Backward)
	require.Empty(t, st.Fallbacks)

	want, err := ref.Eval(g, nil, ids...)
	require.NoError(t, err)
	for i, p := range outs {
		got := f.mem.region(p)
		w := want[i].Data
		require.Len(t, got, len(w), "output %d", i)
		m := 0.0
		for _, v := range w {
			m = math.Max(m, math.Abs(v))
		}
		require.Positive(t, m, "output %d", i)
		for j, v := range w {
			require.False(t, math.IsNaN(got[j]), "output %d [%d] was not written", i, j)
			require.InDelta(t, v, got[j], 1e-9*m, "output %d (%s) [%d]", i, g.Node(ids[i]).Op, j)
		}
	}
}

// TestSDPAWorkspaceRefusedOnFakeCUDNN: a plan whose workspace is beyond
// what the node declared is refused and counted (AttnStats "workspace"),
// for grouped heads as for others, and nothing is executed; a grouped
// backward plan within sdpaGroupedBytes is taken.
func TestSDPAWorkspaceRefusedOnFakeCUDNN(t *testing.T) {
	sh := attnShape{b: 2, h: 4, hkv: 2, t: 64, s: 64, d: 64, scale: 0.125, causal: true}
	x := sdpaDims{b: 2, h: 4, hkv: 2, t: 64, s: 64, d: 64}
	dt := graph.BFloat16
	for _, c := range []struct {
		planWS    int64
		fwd, bwd  bool // taken
		fallbacks int
	}{
		// The arrays end on 256-byte boundaries here, so a plan may use
		// the declaration's 256 bytes of slack too.
		{planWS: sdpaPlanFixed + 256, fwd: true, bwd: true},
		{planWS: sdpaPlanFixed + 257, fwd: false, bwd: true, fallbacks: 1},
		{planWS: sdpaPlanFixed + sdpaGroupedBytes(x) + 256, fwd: false, bwd: true, fallbacks: 1},
		{planWS: sdpaPlanFixed + sdpaGroupedBytes(x) + 257, fwd: false, bwd: false, fallbacks: 2},
		{planWS: 0, fwd: true, bwd: true},
	} {
		f, n := newFakeCUDNN(t, c.planWS)
		fwdWS, bwdWS := sdpaFwdBytes(x), sdpaBwdBytes(x)
		ws := f.mem.alloc(int(bwdWS/4), 4)
		q := f.mem.alloc(2*4*64*64, 2)
		kv := f.mem.alloc(2*2*64*64, 2)
		o := f.mem.alloc(2*4*64*64, 2)
		lse := f.mem.alloc(2*4*64, 4)
		for _, p := range []alloc.Ptr{q, kv, o, lse} {
			r := f.mem.region(p)
			for i := range r {
				r[i] = 0.5
			}
		}
		dq := f.mem.alloc(2*4*64*64, 2)
		dkv := f.mem.alloc(2*2*2*64*64, 2)
		done, err := n.sdpaForward(dt, sh, false, false, q, kv, kv, o, lse, ws, fwdWS)
		require.NoError(t, err)
		require.Equal(t, c.fwd, done, "forward, plan workspace %d", c.planWS)
		done, err = n.sdpaBackward(dt, sh, false, false, o, q, kv, kv, o, lse, dq, dkv, dkv+128, ws, bwdWS)
		require.NoError(t, err)
		require.NoError(t, f.err)
		require.Equal(t, c.bwd, done, "backward, plan workspace %d", c.planWS)
		require.Equal(t, c.fallbacks, n.AttnStats().Fallbacks["workspace"], "%v", n.AttnStats())
	}
}
