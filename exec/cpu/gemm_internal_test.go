package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gonum.org/v1/gonum/blas"
)

// refGemm is c = op(a)·op(b) + beta·c in float64, every term included, so
// a 0·NaN or 0·Inf term gives NaN as IEEE 754 (and cuBLAS, PyTorch) do.
func refGemm(tA, tB blas.Transpose, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) []float64 {
	at := func(i, l int) float64 {
		if tA == blas.NoTrans {
			return float64(a[i*lda+l])
		}
		return float64(a[l*lda+i])
	}
	bt := func(l, j int) float64 {
		if tB == blas.NoTrans {
			return float64(b[l*ldb+j])
		}
		return float64(b[j*ldb+l])
	}
	out := make([]float64, m*n)
	for i := range m {
		for j := range n {
			var s float64
			for l := range k {
				s += at(i, l) * bt(l, j)
			}
			if beta != 0 {
				s += float64(beta) * float64(c[i*ldc+j])
			}
			out[i*n+j] = s
		}
	}
	return out
}

// gemm agrees with the every-term reference on operands holding exact
// zeros, NaNs and infinities, in every transpose combination, with beta 0
// and 1 and strided rows: a NaN or an infinity in a row of op(a) or a
// column of op(b) makes every product entry it reaches NaN or ±Inf
// exactly as the reference does (gonum's kernels skip a zero term, so 0·NaN
// gave 0 there), and finite entries match within float32 sums' rounding
// (atol 1e-5 + rtol 1e-5 over k ≤ 40 terms of magnitude ≤ 1).
func TestGemmPropagatesNaNAndInf(t *testing.T) {
	const atol, rtol = 1e-5, 1e-5
	rng := rand.New(rand.NewPCG(61, 62))
	specials := []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))}
	fill := func(n int, poison int) []float32 {
		d := make([]float32, n)
		for i := range d {
			if rng.IntN(3) > 0 { // a third non-zero: zeros are what gonum skipped
				continue
			}
			d[i] = float32(rng.Float64()*2 - 1)
		}
		for range poison {
			d[rng.IntN(n)] = specials[rng.IntN(len(specials))]
		}
		return d
	}
	trans := []blas.Transpose{blas.NoTrans, blas.Trans}
	cases := 0
	for _, tA := range trans {
		for _, tB := range trans {
			for _, beta := range []float32{0, 1} {
				for _, shape := range [][3]int{{1, 1, 1}, {5, 7, 3}, {16, 9, 40}, {3, 33, 17}} {
					for _, poison := range [][2]int{{0, 0}, {1, 0}, {0, 1}, {2, 3}} {
						m, n, k := shape[0], shape[1], shape[2]
						ar, ac := m, k
						if tA == blas.Trans {
							ar, ac = k, m
						}
						br, bc := k, n
						if tB == blas.Trans {
							br, bc = n, k
						}
						lda, ldb, ldc := ac+2, bc+1, n+3 // strided rows
						a, b := fill(ar*lda, poison[0]), fill(br*ldb, poison[1])
						c := fill(m*ldc, 0)
						want := refGemm(tA, tB, m, n, k, a, lda, b, ldb, beta, c, ldc)
						got := append([]float32(nil), c...)
						gemm(tA, tB, m, n, k, a, lda, b, ldb, beta, got, ldc)
						for i := range m {
							for j := range n {
								w, g := want[i*n+j], float64(got[i*ldc+j])
								what := fmt.Sprintf("tA %c tB %c beta %g shape %v poison %v: c[%d][%d]", tA, tB, beta, shape, poison, i, j)
								switch {
								case math.IsNaN(w):
									require.True(t, math.IsNaN(g), "%s: want NaN, got %g", what, g)
								case math.IsInf(w, 0):
									require.Equal(t, w, g, what)
								default:
									require.InDelta(t, w, g, atol+rtol*math.Abs(w), what)
								}
							}
						}
						cases++
					}
				}
			}
		}
	}
	require.Equal(t, 2*2*2*4*4, cases)
}

// The every-term path is taken only for operands holding a NaN or an
// infinity; on finite data the scan that decides it is all the fix costs,
// and BenchmarkGemm times it alone beside the product (_scan). On a quiet
// moment of the shared two-core machine: 512³ 22 ms, its scan 0.09 ms;
// 4096×16×64 1.9–3.1 ms, scan 0.04 ms; 64×4096×64 3.0 ms, scan 0.04 ms
// (0.4–2 %; products with and without the scan differed by less than
// the machine's noise).
func BenchmarkGemm(b *testing.B) {
	for _, s := range []struct {
		name    string
		m, n, k int
	}{{"512x512x512", 512, 512, 512}, {"4096x16x64_narrow", 4096, 16, 64}, {"64x4096x64_wide", 64, 4096, 64}} {
		b.Run(s.name, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(63, 64))
			a, w := make([]float32, s.m*s.k), make([]float32, s.k*s.n)
			for i := range a {
				a[i] = float32(rng.Float64()*2 - 1)
			}
			for i := range w {
				w[i] = float32(rng.Float64()*2 - 1)
			}
			c := make([]float32, s.m*s.n)
			b.SetBytes(int64(4 * (len(a) + len(w) + len(c))))
			for b.Loop() {
				gemm(blas.NoTrans, blas.NoTrans, s.m, s.n, s.k, a, s.k, w, s.n, 0, c, s.n)
			}
			b.ReportMetric(2*float64(s.m*s.n*s.k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		// The scan alone: its time over the product's is the fix's cost.
		b.Run(s.name+"_scan", func(b *testing.B) {
			a, w := make([]float32, s.m*s.k), make([]float32, s.k*s.n)
			b.SetBytes(int64(4 * (len(a) + len(w))))
			for b.Loop() {
				if !finite(a, s.m, s.k, s.k) || !finite(w, s.k, s.n, s.n) {
					b.Fatal("zeros are finite")
				}
			}
		})
	}
}
