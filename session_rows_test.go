package batchfit_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// The batch of the row tests: n sequences of seqLen tokens from a
// vocabulary of vocab, embedded in dim, classified into nClass.
const (
	rowsN      = 512
	rowsSeqLen = 16
	rowsVocab  = 100
	rowsDim    = 128
	rowsClass  = 16
)

// rowsCase is one bad value for the row tests: loss is the graph of
// tokens [n, seqLen] and labels of shape labels; spoil puts a bad value in
// sample s and returns the row and position (in the bad input's
// whole-batch shape) the error is to name.
type rowsCase struct {
	name   string
	op     string
	labels []int
	loss   func(tokens, labels *tensor.Dense) *lazy.Tensor
	spoil  func(tokens, labels *tensor.Dense, s int) (row, pos int)
	shape  []int
}

func rowsCases() []rowsCase {
	head := nn.NewLinear(nn.Seed(31), rowsDim, rowsClass, true)
	w := lazy.Param(testutil.UniformF32(rand.New(rand.NewPCG(31, 32)), rowsVocab, rowsDim), "w")
	const j = rowsSeqLen / 2 // the bad token of a sequence
	perSample := func(tokens, labels *tensor.Dense) *lazy.Tensor {
		x := lazy.Wrap(tokens, 0)
		return head.Forward(x.Embedding(w).Sum(1)).CrossEntropy(x.Graph().Wrap(labels, 0), graph.ReduceMean)
	}
	return []rowsCase{{
		name: "label per sample", op: "cross_entropy", labels: []int{rowsN}, shape: []int{rowsN},
		loss: perSample,
		spoil: func(_, labels *tensor.Dense, s int) (int, int) {
			labels.Int64s()[s] = rowsClass
			return s, s
		},
	}, {
		// The labels' batch axis folds seqLen rows per sample.
		name: "label per token", op: "cross_entropy", labels: []int{rowsN, rowsSeqLen}, shape: []int{rowsN * rowsSeqLen},
		loss: func(tokens, labels *tensor.Dense) *lazy.Tensor {
			x := lazy.Wrap(tokens, 0)
			h := x.Embedding(w).Reshape(rowsN*rowsSeqLen, rowsDim)
			y := x.Graph().Wrap(labels, 0).Reshape(rowsN * rowsSeqLen)
			return head.Forward(h).CrossEntropy(y, graph.ReduceMean)
		},
		spoil: func(_, labels *tensor.Dense, s int) (int, int) {
			labels.Int64s()[s*rowsSeqLen+j] = -1
			return s*rowsSeqLen + j, s*rowsSeqLen + j
		},
	}, {
		name: "embedding index", op: "embedding", labels: []int{rowsN}, shape: []int{rowsN, rowsSeqLen},
		loss: perSample,
		spoil: func(tokens, _ *tensor.Dense, s int) (int, int) {
			tokens.Int64s()[s*rowsSeqLen+j] = rowsVocab
			return s, s*rowsSeqLen + j
		},
	}}
}

// checkRowError runs each of rowsCases through Session.Eval on a session
// that open gives for a plan budget, the smallest one at which programs
// with the workspace rule ws run (in three chunks or more): the bad
// value, in the third chunk, is to be reported at the caller's row.
func checkRowError(t *testing.T, ws planner.WorkspaceFunc, open func(t *testing.T, planBudget int64) *batchfit.Session) {
	ctx := context.Background()
	for _, c := range rowsCases() {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(33, 34))
			tokens := testutil.Classes(rng, rowsVocab, rowsN, rowsSeqLen)
			labels := testutil.Classes(rng, rowsClass, c.labels...)
			budget, chunks := evalChunks(t, ws, c.loss(tokens, labels))
			require.GreaterOrEqual(t, len(chunks), 3, "the smallest budget (%d bytes) runs in chunks", budget)
			ch := chunks[2]
			s := ch.Start + ch.Size/2
			row, pos := c.spoil(tokens, labels, s)

			_, err := open(t, budget).Eval(ctx, c.loss(tokens, labels))
			require.ErrorIs(t, err, graph.ErrAttr)
			var oe *graph.OpError
			require.ErrorAs(t, err, &oe)
			require.Equal(t, c.op, oe.Op)
			var ce *exec.ChunkError
			require.ErrorAs(t, err, &ce)
			require.Equal(t, [2]int{ch.Start, ch.Size}, [2]int{ce.Start, ce.Size}, "the chunk of sample %d", s)
			var re *exec.RowError
			require.ErrorAs(t, err, &re)
			require.Equal(t, row, re.Row, "the caller's row: %v", err)
			require.Equal(t, pos, re.Pos, "the caller's position: %v", err)
			require.Equal(t, c.shape, re.Shape)
			at := fmt.Sprintf("row %d", row)
			if len(c.shape) > 1 {
				at = fmt.Sprintf("position %d (row %d along the batch axis)", pos, row)
			}
			require.ErrorContains(t, err, at)
			t.Log(err)
		})
	}
}

// An error raised inside a chunk names the caller's row,
// not the chunk's, in its message and in the typed exec.RowError: a label
// of a sample, a label of a token (the batch axis folds a sequence's rows)
// and an embedding index, each in the third chunk.
func TestChunkErrorNamesGlobalRow(t *testing.T) {
	checkRowError(t, cpu.Workspace, func(t *testing.T, planBudget int64) *batchfit.Session {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: planBudget})
		require.NoError(t, sess.Err())
		t.Cleanup(func() { require.NoError(t, sess.Close()) })
		return sess
	})
}

// evalChunks compiles out's graph as Session.Eval does, with the workspace
// rule ws, and returns the smallest plan budget the planner accepts (the
// most chunks) and its chunks.
func evalChunks(t *testing.T, ws planner.WorkspaceFunc, out *lazy.Tensor) (int64, []planner.Chunk) {
	t.Helper()
	require.NoError(t, out.Err())
	g := out.Graph().IR()
	info, err := shapeinfer.Analyze(g, out.ID())
	require.NoError(t, err)
	p, err := planner.Compile(g, info, []int{out.ID()}, planner.CompileOptions{Workspace: ws})
	require.NoError(t, err)
	for b := int64(alloc.RoundLarge); ; b += alloc.RoundLarge {
		pl, err := planner.Make(p, planner.Options{Budget: b})
		if errors.Is(err, planner.ErrDoesNotFit) {
			continue
		}
		require.NoError(t, err)
		return b, pl.Chunks
	}
}
