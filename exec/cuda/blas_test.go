package cuda_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
)

// Tolerances for GEMM, relative to Σ|a·b| (the magnitude of the terms
// summed), which bounds rounding error regardless of cancellation.
const (
	rtolFP32 = 1e-4
	rtolTF32 = 5e-3 // inputs rounded to 10-bit mantissas
)

// gemmCase is one row-major GEMM with padded leading dimensions, batched
// with strides that leave gaps between matrices.
type gemmCase struct {
	transA, transB bool
	m, n, k, batch int
	alpha, beta    float32
}

func (c gemmCase) String() string {
	return fmt.Sprintf("tA=%t,tB=%t,%dx%dx%d,batch=%d", c.transA, c.transB, c.m, c.n, c.k, c.batch)
}

// run executes c on the device and checks it against a float64 reference.
func (c gemmCase) run(t *testing.T, d *cuda.Device, a *alloc.Allocator, bl *cuda.BLAS, r *rand.Rand, rtol float64) {
	t.Helper()
	rowsA, colsA := c.m, c.k
	if c.transA {
		rowsA, colsA = c.k, c.m
	}
	rowsB, colsB := c.k, c.n
	if c.transB {
		rowsB, colsB = c.n, c.k
	}
	lda, ldb, ldc := colsA+2, colsB+1, c.n+3
	strideA, strideB, strideC := rowsA*lda+5, rowsB*ldb+7, c.m*ldc+1
	A := testutil.RandFloats(r, c.batch*strideA)
	B := testutil.RandFloats(r, c.batch*strideB)
	C0 := testutil.RandFloats(r, c.batch*strideC)
	Ab, Bb, Cb := upload(t, d, a, A), upload(t, d, a, B), upload(t, d, a, C0)
	defer func() {
		for _, b := range []*alloc.Block{Ab, Bb, Cb} {
			require.NoError(t, a.Free(b))
		}
	}()
	if c.batch == 1 {
		require.NoError(t, bl.Gemm(c.transA, c.transB, c.m, c.n, c.k, c.alpha,
			Ab.Ptr(), lda, Bb.Ptr(), ldb, c.beta, Cb.Ptr(), ldc))
	} else {
		require.NoError(t, bl.GemmStridedBatched(c.transA, c.transB, c.m, c.n, c.k, c.alpha,
			Ab.Ptr(), lda, int64(strideA), Bb.Ptr(), ldb, int64(strideB),
			c.beta, Cb.Ptr(), ldc, int64(strideC), c.batch))
	}
	got := download(t, d, Cb, len(C0))

	for bi := 0; bi < c.batch; bi++ {
		opA := func(i, p int) float64 {
			if c.transA {
				return float64(A[bi*strideA+p*lda+i])
			}
			return float64(A[bi*strideA+i*lda+p])
		}
		opB := func(p, j int) float64 {
			if c.transB {
				return float64(B[bi*strideB+j*ldb+p])
			}
			return float64(B[bi*strideB+p*ldb+j])
		}
		for i := 0; i < c.m; i++ {
			for j := 0; j < ldc; j++ {
				at := bi*strideC + i*ldc + j
				if j >= c.n { // padding is not written
					require.Equal(t, C0[at], got[at], "batch %d padding (%d,%d)", bi, i, j)
					continue
				}
				var sum, mag float64
				for p := 0; p < c.k; p++ {
					sum += opA(i, p) * opB(p, j)
					mag += math.Abs(opA(i, p) * opB(p, j))
				}
				ref := float64(c.alpha)*sum + float64(c.beta)*float64(C0[at])
				scale := math.Abs(float64(c.alpha))*mag + math.Abs(float64(c.beta)*float64(C0[at]))
				require.LessOrEqual(t, math.Abs(float64(got[at])-ref), rtol*scale,
					"batch %d C[%d,%d] = %v, want %v", bi, i, j, got[at], ref)
			}
		}
	}
}

func newBLAS(t *testing.T, d *cuda.Device, a *alloc.Allocator) *cuda.BLAS {
	t.Helper()
	bl, err := d.NewBLAS(a, cuda.DefaultWorkspace)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, bl.Close()) })
	return bl
}

func gemmCases(batch int) []gemmCase {
	var cs []gemmCase
	for _, tA := range []bool{false, true} {
		for _, tB := range []bool{false, true} {
			cs = append(cs, gemmCase{tA, tB, 67, 45, 33, batch, 1, 0})
		}
	}
	cs = append(cs, gemmCase{false, true, 40, 70, 129, batch, -0.5, 1.25}) // C = α·A·Bᵀ + β·C
	return cs
}

func TestGemm(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	bl := newBLAS(t, d, a)
	r := newRand(5)
	for _, c := range gemmCases(1) {
		t.Run(c.String(), func(t *testing.T) { c.run(t, d, a, bl, r, rtolFP32) })
	}
}

func TestGemmStridedBatched(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	bl := newBLAS(t, d, a)
	r := newRand(6)
	for _, c := range gemmCases(3) {
		t.Run(c.String(), func(t *testing.T) { c.run(t, d, a, bl, r, rtolFP32) })
	}
}

func TestGemmTF32(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	bl := newBLAS(t, d, a)
	require.NoError(t, bl.SetTF32(true))
	r := newRand(7)
	for _, c := range append(gemmCases(1), gemmCase{true, false, 128, 256, 512, 2, 1, 0}) {
		t.Run(c.String(), func(t *testing.T) { c.run(t, d, a, bl, r, rtolTF32) })
	}
	require.NoError(t, bl.SetTF32(false))
}

// TestBLASWorkspace: the cuBLAS workspace is a block of the caching
// allocator, allocated while the handle lives.
func TestBLASWorkspace(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	before := a.Stats().AllocatedBytes[alloc.All].Current
	bl, err := d.NewBLAS(a, cuda.DefaultWorkspace)
	require.NoError(t, err)
	require.NotNil(t, bl.Workspace())
	assert.Equal(t, before+cuda.DefaultWorkspace, a.Stats().AllocatedBytes[alloc.All].Current)
	require.NoError(t, bl.Close())
	require.NoError(t, bl.Close())
	assert.Equal(t, before, a.Stats().AllocatedBytes[alloc.All].Current)
	assert.ErrorIs(t, bl.SetTF32(true), cuda.ErrClosed)

	none, err := d.NewBLAS(a, 0)
	require.NoError(t, err)
	assert.Nil(t, none.Workspace())
	assert.Equal(t, before, a.Stats().AllocatedBytes[alloc.All].Current)
	require.NoError(t, none.Close())

	_, err = d.NewBLAS(a, -1)
	assert.ErrorIs(t, err, graph.ErrAttr)
	_, err = d.NewBLAS(nil, 0)
	assert.ErrorIs(t, err, graph.ErrAttr)
}

func TestGemmBadShapes(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	bl := newBLAS(t, d, a)
	// Nothing is launched for these, so no memory is needed.
	assert.ErrorIs(t, bl.Gemm(false, false, 4, 5, 6, 1, 0, 5, 0, 5, 0, 0, 5), graph.ErrShape, "lda < k")
	assert.ErrorIs(t, bl.Gemm(true, false, 4, 5, 6, 1, 0, 4, 0, 4, 0, 0, 5), graph.ErrShape, "ldb < n")
	assert.ErrorIs(t, bl.Gemm(false, false, -1, 5, 6, 1, 0, 6, 0, 5, 0, 0, 5), graph.ErrShape, "negative m")
	assert.ErrorIs(t, bl.GemmStridedBatched(false, false, 4, 5, 6, 1, 0, 6, -1, 0, 5, 0, 0, 0, 5, 0, 2),
		graph.ErrShape, "negative stride")
	require.NoError(t, bl.Gemm(false, false, 0, 5, 6, 1, 0, 6, 0, 5, 0, 0, 5), "empty product")
}
