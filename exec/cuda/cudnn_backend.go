package cuda

import (
	"errors"
	"fmt"
	"unsafe"
)

// cuDNN's backend (graph) API: opaque descriptors typed by
// cudnnBackendDescriptorType_t, set attribute by attribute, finalized, and
// an execution plan run over a variant pack of device pointers
// (libcudnn_graph.so.9, re-exported by the libcudnn.so.9 shim).
//
// Every value below is cuDNN 9's (cudnn_graph.h of cuDNN 9.x). cuDNN 9
// renumbered the attribute names: CUDNN_ATTR_OPERATION_MATMUL_ADESC is 1520
// there and was 60 in cuDNN 8, so these must not be mixed with cuDNN 8's
// headers. The descriptor types, attribute types, data types, pointwise
// modes, reduction operators and heuristic modes kept their values. All
// 86 values here were checked against cudnn_graph.h of cuDNN 9.14.0 (the
// GPU machine's /usr/include/x86_64-linux-gnu/cudnn_graph.h).

// cudnnBackendDescriptorType_t.
const (
	cudnnBackendPointwiseDesc     = 0
	cudnnBackendEngineDesc        = 2
	cudnnBackendEngineCfgDesc     = 3
	cudnnBackendEngineHeurDesc    = 4
	cudnnBackendExecutionPlanDesc = 5
	cudnnBackendOpPointwiseDesc   = 13
	cudnnBackendOperationGraph    = 15
	cudnnBackendVariantPackDesc   = 16
	cudnnBackendTensorDesc        = 17
	cudnnBackendMatmulDesc        = 18
	cudnnBackendOpMatmulDesc      = 19
	cudnnBackendReductionDesc     = 21
	cudnnBackendOpReductionDesc   = 22
	cudnnBackendOpReshapeDesc     = 31
)

// cudnnBackendAttributeName_t (cuDNN 9 numbering).
const (
	cudnnAttrPointwiseMode     = 0
	cudnnAttrPointwiseMathPrec = 1
	cudnnAttrPointwiseAxis     = 9

	cudnnAttrEngineHeurMode           = 200
	cudnnAttrEngineHeurOperationGraph = 201
	cudnnAttrEngineHeurResults        = 202

	cudnnAttrEngineCfgEngine = 300

	cudnnAttrExecutionPlanHandle        = 400
	cudnnAttrExecutionPlanEngineConfig  = 401
	cudnnAttrExecutionPlanWorkspaceSize = 402

	cudnnAttrOpPointwisePWDesc = 750
	cudnnAttrOpPointwiseXDesc  = 751
	cudnnAttrOpPointwiseBDesc  = 752
	cudnnAttrOpPointwiseYDesc  = 753
	cudnnAttrOpPointwiseAlpha1 = 754
	cudnnAttrOpPointwiseAlpha2 = 755
	cudnnAttrOpPointwiseTDesc  = 758

	cudnnAttrOperationGraphHandle = 800
	cudnnAttrOperationGraphOps    = 801

	cudnnAttrTensorByteAlignment = 900
	cudnnAttrTensorDataType      = 901
	cudnnAttrTensorDimensions    = 902
	cudnnAttrTensorStrides       = 903
	cudnnAttrTensorUniqueID      = 906
	cudnnAttrTensorIsVirtual     = 907
	cudnnAttrTensorIsByValue     = 908

	cudnnAttrVariantPackUniqueIDs    = 1000
	cudnnAttrVariantPackDataPointers = 1001
	cudnnAttrVariantPackWorkspace    = 1003

	cudnnAttrEngineGlobalIndex = 1301

	cudnnAttrMatmulCompType    = 1500
	cudnnAttrOpMatmulADesc     = 1520
	cudnnAttrOpMatmulBDesc     = 1521
	cudnnAttrOpMatmulCDesc     = 1522
	cudnnAttrOpMatmulDesc      = 1523
	cudnnAttrReductionOperator = 1600
	cudnnAttrReductionCompType = 1601
	cudnnAttrOpReductionXDesc  = 1610
	cudnnAttrOpReductionYDesc  = 1611
	cudnnAttrOpReductionDesc   = 1612
	cudnnAttrOpReshapeXDesc    = 2200
	cudnnAttrOpReshapeYDesc    = 2201
)

// cudnnBackendAttributeType_t.
const (
	cudnnTypeHandle            = 0
	cudnnTypeDataType          = 1
	cudnnTypeBoolean           = 2
	cudnnTypeInt64             = 3
	cudnnTypeFloat             = 4
	cudnnTypeVoidPtr           = 6
	cudnnTypeHeurMode          = 8
	cudnnTypePointwiseMode     = 14
	cudnnTypeBackendDescriptor = 15
	cudnnTypeReductionOperator = 18
)

// cudnnDataType_t values the graphs use beside cudnnDataFloat, Half and
// BFloat16 (cudnn.go).
const (
	cudnnDataInt32   = 4
	cudnnDataBoolean = 11
)

// cudnnPointwiseMode_t.
const (
	cudnnPointwiseAdd          = 0
	cudnnPointwiseMul          = 1
	cudnnPointwiseDiv          = 6
	cudnnPointwiseSub          = 9
	cudnnPointwiseExp          = 13
	cudnnPointwiseLog          = 15
	cudnnPointwiseIdentity     = 21
	cudnnPointwiseCmpGE        = 303
	cudnnPointwiseGenIndex     = 501
	cudnnPointwiseBinarySelect = 601
)

// cudnnReduceTensorOp_t, the backend's reduction operators.
const (
	cudnnReduceAdd = 0
	cudnnReduceMax = 3
)

// cudnnBackendHeurMode_t.
const (
	cudnnHeurModeB        = 1
	cudnnHeurModeFallback = 2
	cudnnHeurModeA        = 3
)

// cudnnBackendLib holds the backend API's entry points; C signatures in
// the comments. Descriptors are opaque pointers (cudnnBackendDescriptor_t).
type cudnnBackendLib struct {
	// cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t t, cudnnBackendDescriptor_t *d)
	cudnnBackendCreateDescriptor func(t int32, d *uintptr) cudnnStatus
	// cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d)
	cudnnBackendDestroyDescriptor func(d uintptr) cudnnStatus
	// cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t d)
	cudnnBackendFinalize func(d uintptr) cudnnStatus
	// cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
	//     cudnnBackendAttributeType_t type, int64_t elementCount, const void *arrayOfElements)
	cudnnBackendSetAttribute func(d uintptr, name, typ int32, count int64, elems unsafe.Pointer) cudnnStatus
	// cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const d, cudnnBackendAttributeName_t name,
	//     cudnnBackendAttributeType_t type, int64_t requestedElementCount, int64_t *elementCount, void *arrayOfElements)
	cudnnBackendGetAttribute func(d uintptr, name, typ int32, requested int64, count *int64, elems unsafe.Pointer) cudnnStatus
	// cudnnStatus_t cudnnBackendExecute(cudnnHandle_t h, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t variantPack)
	cudnnBackendExecute func(h cudnnHandle, plan, pack uintptr) cudnnStatus
}

func (c *cudnnBackendLib) symbols() []symbol {
	return []symbol{
		sym(&c.cudnnBackendCreateDescriptor, "cudnnBackendCreateDescriptor"),
		sym(&c.cudnnBackendDestroyDescriptor, "cudnnBackendDestroyDescriptor"),
		sym(&c.cudnnBackendFinalize, "cudnnBackendFinalize"),
		sym(&c.cudnnBackendSetAttribute, "cudnnBackendSetAttribute"),
		sym(&c.cudnnBackendGetAttribute, "cudnnBackendGetAttribute"),
		sym(&c.cudnnBackendExecute, "cudnnBackendExecute"),
	}
}

// errNoBackendAPI is why SDPA cannot run when the loaded cuDNN lacks the
// backend API's symbols.
var errNoBackendAPI = fmt.Errorf("%w: cudnn: no backend (graph) API", ErrNoLibrary)

// bgraph builds backend descriptors, keeping the first error and every
// descriptor it made (destroyed together by destroy, or handed to a plan
// that keeps them).
type bgraph struct {
	lib   *cudnnLib
	be    *cudnnBackendLib
	err   error
	descs []uintptr
	ops   []uintptr
	uid   int64   // the next virtual tensor's unique id
	byVal []int64 // the by-value tensors' unique ids, in creation order
}

// create makes a descriptor of type t (0 once an error happened).
func (b *bgraph) create(t int32) uintptr {
	if b.err != nil {
		return 0
	}
	var d uintptr
	if b.err = b.lib.check("cudnnBackendCreateDescriptor", b.be.cudnnBackendCreateDescriptor(t, &d)); b.err != nil {
		return 0
	}
	b.descs = append(b.descs, d)
	return d
}

// set sets attribute name of d to the n elements at p, of type typ.
func (b *bgraph) set(d uintptr, name, typ int32, n int64, p unsafe.Pointer) {
	if b.err != nil {
		return
	}
	if s := b.be.cudnnBackendSetAttribute(d, name, typ, n, p); s != 0 {
		b.err = fmt.Errorf("attribute %d: %w", name, b.lib.check("cudnnBackendSetAttribute", s))
	}
}

func (b *bgraph) setInt64s(d uintptr, name int32, v ...int64) {
	b.set(d, name, cudnnTypeInt64, int64(len(v)), unsafe.Pointer(&v[0]))
}

func (b *bgraph) setInt32(d uintptr, name, typ int32, v int32) {
	b.set(d, name, typ, 1, unsafe.Pointer(&v))
}

func (b *bgraph) setDesc(d uintptr, name int32, v ...uintptr) {
	b.set(d, name, cudnnTypeBackendDescriptor, int64(len(v)), unsafe.Pointer(&v[0]))
}

func (b *bgraph) finalize(d uintptr, what string) {
	if b.err != nil {
		return
	}
	if s := b.be.cudnnBackendFinalize(d); s != 0 {
		b.err = fmt.Errorf("finalizing %s: %w", what, b.lib.check("cudnnBackendFinalize", s))
	}
}

// btensor is a tensor descriptor with its unique id.
type btensor struct {
	d   uintptr
	uid int64
}

// tensor is a finalized tensor descriptor: dims and strides, data type dt,
// 16-byte aligned, virtual (an intermediate the engine keeps on chip) or
// by value (a host scalar in the variant pack). uid 0 takes the next
// virtual id.
func (b *bgraph) tensor(uid int64, dt int32, dims, strides []int64, virtual, byValue bool) btensor {
	if uid == 0 {
		uid = b.uid
		b.uid++
	}
	d := b.create(cudnnBackendTensorDesc)
	b.setInt32(d, cudnnAttrTensorDataType, cudnnTypeDataType, dt)
	b.setInt64s(d, cudnnAttrTensorDimensions, dims...)
	b.setInt64s(d, cudnnAttrTensorStrides, strides...)
	b.setInt64s(d, cudnnAttrTensorUniqueID, uid)
	b.setInt64s(d, cudnnAttrTensorByteAlignment, 16)
	v, bv := boolByte(virtual), boolByte(byValue)
	b.set(d, cudnnAttrTensorIsVirtual, cudnnTypeBoolean, 1, unsafe.Pointer(&v))
	b.set(d, cudnnAttrTensorIsByValue, cudnnTypeBoolean, 1, unsafe.Pointer(&bv))
	b.finalize(d, "tensor")
	if byValue {
		b.byVal = append(b.byVal, uid)
	}
	return btensor{d: d, uid: uid}
}

// boolByte is a C bool (cudnn's CUDNN_TYPE_BOOLEAN is one byte).
func boolByte(v bool) byte {
	if v {
		return 1
	}
	return 0
}

// virt is a virtual tensor of dims and strides.
func (b *bgraph) virt(dt int32, dims, strides []int64) btensor {
	return b.tensor(0, dt, dims, strides, true, false)
}

// pointwise appends y = mode(x[, b[, t]]) computed in prec; axis ≥ 0 sets
// GEN_INDEX's axis.
func (b *bgraph) pointwise(mode int32, prec int32, axis int64, y btensor, xs ...btensor) {
	pw := b.create(cudnnBackendPointwiseDesc)
	b.setInt32(pw, cudnnAttrPointwiseMode, cudnnTypePointwiseMode, mode)
	b.setInt32(pw, cudnnAttrPointwiseMathPrec, cudnnTypeDataType, prec)
	if axis >= 0 {
		b.setInt64s(pw, cudnnAttrPointwiseAxis, axis)
	}
	b.finalize(pw, "pointwise descriptor")
	op := b.create(cudnnBackendOpPointwiseDesc)
	b.setDesc(op, cudnnAttrOpPointwisePWDesc, pw)
	b.setDesc(op, cudnnAttrOpPointwiseXDesc, xs[0].d)
	if len(xs) > 1 {
		b.setDesc(op, cudnnAttrOpPointwiseBDesc, xs[1].d)
	}
	if len(xs) > 2 {
		b.setDesc(op, cudnnAttrOpPointwiseTDesc, xs[2].d)
	}
	b.setDesc(op, cudnnAttrOpPointwiseYDesc, y.d)
	one := float32(1)
	b.set(op, cudnnAttrOpPointwiseAlpha1, cudnnTypeFloat, 1, unsafe.Pointer(&one))
	b.set(op, cudnnAttrOpPointwiseAlpha2, cudnnTypeFloat, 1, unsafe.Pointer(&one))
	b.finalize(op, "pointwise operation")
	b.ops = append(b.ops, op)
}

// matmul appends c = a·b (batched over the leading dims), float32 sums.
func (b *bgraph) matmul(a, bb, c btensor) {
	mm := b.create(cudnnBackendMatmulDesc)
	b.setInt32(mm, cudnnAttrMatmulCompType, cudnnTypeDataType, cudnnDataFloat)
	b.finalize(mm, "matmul descriptor")
	op := b.create(cudnnBackendOpMatmulDesc)
	b.setDesc(op, cudnnAttrOpMatmulADesc, a.d)
	b.setDesc(op, cudnnAttrOpMatmulBDesc, bb.d)
	b.setDesc(op, cudnnAttrOpMatmulCDesc, c.d)
	b.setDesc(op, cudnnAttrOpMatmulDesc, mm)
	b.finalize(op, "matmul operation")
	b.ops = append(b.ops, op)
}

// reduction appends y = mode over the axes where y's dim is 1 and x's is
// not, in float32.
func (b *bgraph) reduction(mode int32, x, y btensor) {
	r := b.create(cudnnBackendReductionDesc)
	b.setInt32(r, cudnnAttrReductionOperator, cudnnTypeReductionOperator, mode)
	b.setInt32(r, cudnnAttrReductionCompType, cudnnTypeDataType, cudnnDataFloat)
	b.finalize(r, "reduction descriptor")
	op := b.create(cudnnBackendOpReductionDesc)
	b.setDesc(op, cudnnAttrOpReductionDesc, r)
	b.setDesc(op, cudnnAttrOpReductionXDesc, x.d)
	b.setDesc(op, cudnnAttrOpReductionYDesc, y.d)
	b.finalize(op, "reduction operation")
	b.ops = append(b.ops, op)
}

// reshape appends y = x seen with y's dims and strides (a transpose view).
func (b *bgraph) reshape(x, y btensor) {
	op := b.create(cudnnBackendOpReshapeDesc)
	b.setDesc(op, cudnnAttrOpReshapeXDesc, x.d)
	b.setDesc(op, cudnnAttrOpReshapeYDesc, y.d)
	b.finalize(op, "reshape operation")
	b.ops = append(b.ops, op)
}

// destroy destroys every descriptor b made.
func (b *bgraph) destroy() error {
	var errs []error
	for i := len(b.descs) - 1; i >= 0; i-- {
		errs = append(errs, b.lib.check("cudnnBackendDestroyDescriptor", b.be.cudnnBackendDestroyDescriptor(b.descs[i])))
	}
	b.descs = nil
	return errors.Join(errs...)
}
