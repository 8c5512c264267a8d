package main

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// resnetPlan builds a ResNet's training step over [b, 3, size, size]
// images the way the library's users would (batch norms in training mode,
// PyTorch's default), and plans it with AdamW's state and the CUDA
// executor's workspaces: the independent route to the CLI's numbers.
func resnetPlan(t *testing.T, cfg models.ResNetConfig, b, size int, budget int64) (*shapeinfer.Result, *planner.Plan, error) {
	t.Helper()
	m := models.NewResNet(nn.Options{ShapeOnly: true}, cfg)
	x := lazy.Placeholder([]int{b, 3, size, size}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{b}, graph.Int64, 0)
	loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	params := nn.ParamTensors(m)
	outs := []int{loss.ID()}
	var trained []int
	for i, gr := range lazy.Grad(loss, params...) {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
		trained = append(trained, loss.Graph().NodeOf(params[i]))
	}
	g, ids, err := graph.FusePointwise(loss.Graph().IR(), outs) // as a step does
	require.NoError(t, err)
	for i := range outs {
		outs[i] = ids[outs[i]]
	}
	for i := range trained {
		trained[i] = ids[trained[i]]
	}
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, planner.CompileOptions{Kept: outs[1:], Trained: trained,
		StateSlots: optim.NewAdamW(1e-3).StateSlots(), Workspace: cuda.Workspace})
	require.NoError(t, err)
	pl, err := planner.Make(p, planner.Options{Budget: budget, NoHeadroom: true, NoChunkList: true})
	return info, pl, err
}

// h100Budget is what estimate --gpu h100-80gb plans with.
func h100Budget(t *testing.T) int64 {
	t.Helper()
	c, err := parseEstimate([]string{"--model", "resnet50", "--batch", "1", "--gpu", "h100-80gb"})
	require.NoError(t, err)
	return c.budget
}

// ResNet-50 at batch 64 on an H100 80GB: training-mode batch norm makes the
// step not chunkable, the whole batch fits, and the report says both.
func TestEstimateResNet50(t *testing.T) {
	budget := h100Budget(t)
	info, want, err := resnetPlan(t, models.ResNet50(1000), 64, 224, budget)
	require.NoError(t, err)
	require.False(t, info.Chunkable())

	args := []string{"estimate", "--model", "resnet50", "--batch", "64", "--gpu", "h100-80gb"}
	code, stdout, stderr := runCLI(append(args, "--json")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, int64(25_557_032), r.Params)
	assert.Equal(t, "float32[64 3 224 224]", r.Input)
	assert.Equal(t, "int64[64]", r.Labels)
	assert.Equal(t, info.NotChunkable.Error(), r.NotChunkable)
	assert.Contains(t, r.NotChunkable, "node 6 (batch_norm in bn1)")
	require.NotNil(t, r.Plan)
	assert.True(t, r.Plan.WholeBatch)
	assert.Equal(t, []chunkRun{{Count: 1, Size: 64}}, r.Plan.Chunks)
	assert.Equal(t, want.PeakReserved, r.Plan.PeakReserved)
	assert.Equal(t, want.PeakAllocated, r.Plan.PeakAllocated)

	code, stdout, stderr = runCLI(args...)
	require.Equal(t, exitOK, code, stderr)
	assert.Empty(t, stderr)
	for _, s := range []string{"25,557,032", "yes: the whole batch of 64 runs in one chunk",
		"chunking         none: " + info.NotChunkable.Error(),
		"affine fit       none (the batch cannot run in chunks)", exact(want.PeakReserved)} {
		assert.Contains(t, stdout, s)
	}
}

// A batch that does not fit and cannot run in chunks: the error is the
// planner's, naming the batch_norm node, and says how large a batch runs in
// one piece; the plan at that batch fits and one more sample does not.
func TestEstimateResNet50DoesNotFit(t *testing.T) {
	args := []string{"estimate", "--model", "resnet50", "--batch", "1024", "--gpu", "h100-80gb"}
	c, err := parseEstimate(args[1:])
	require.NoError(t, err)
	_, err = estimate(c)
	assert.ErrorIs(t, err, planner.ErrDoesNotFit)
	assert.ErrorIs(t, err, graph.ErrNotChunkable)
	var dnf *planner.DoesNotFitError
	require.ErrorAs(t, err, &dnf)
	var ce *shapeinfer.ChunkError
	require.True(t, errors.As(dnf.Reason, &ce))
	assert.Equal(t, "batch_norm", ce.Op)
	assert.Equal(t, "bn1", ce.Scope)
	assert.False(t, errors.Is(err, errUsage))

	code, stdout, _ := runCLI(append(args, "--json")...)
	require.Equal(t, exitPlan, code)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	require.Nil(t, r.Plan)
	require.NotNil(t, r.DoesNotFit)
	n := r.DoesNotFit.LargestWholeBatch
	require.Greater(t, n, 1)
	require.Less(t, n, 1024)
	assert.Contains(t, r.DoesNotFit.Reason, "batch_norm in bn1")

	budget := h100Budget(t)
	_, pl, err := resnetPlan(t, models.ResNet50(1000), n, 224, budget)
	require.NoError(t, err, "%d samples fit", n)
	assert.Equal(t, 1, pl.Split.Len())
	_, _, err = resnetPlan(t, models.ResNet50(1000), n+1, 224, budget)
	assert.ErrorIs(t, err, planner.ErrDoesNotFit, "%d do not", n+1)

	code, stdout, stderr := runCLI(args...)
	require.Equal(t, exitPlan, code)
	first, rest, _ := strings.Cut(stderr, "\n")
	assert.Empty(t, rest, "one line")
	assert.True(t, strings.HasPrefix(first, "batchfit estimate: does not fit the memory budget"), first)
	assert.Contains(t, first, "the whole batch must run at once: graph is not chunkable along its batch: node 6 (batch_norm in bn1)")
	assert.True(t, strings.HasSuffix(first, "; at most "+itoa(n)+" samples run in one piece"), first)
	assert.Contains(t, stdout, "no: the whole batch of 1024 needs ")
	assert.Contains(t, stdout, "and cannot run in chunks: graph is not chunkable along its batch: node 6 (batch_norm in bn1)")
	assert.Contains(t, stdout, "largest batch    "+itoa(n)+" samples in one piece")
}

// Inference runs the batch norms on their running statistics (PyTorch's
// eval()): per-sample, so a tight budget splits the batch into chunks.
func TestEstimateResNetInferenceChunks(t *testing.T) {
	code, stdout, stderr := runCLI("estimate", "--model", "resnet18", "--batch", "256", "--budget", "1GiB", "--mode", "infer", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Empty(t, r.NotChunkable)
	require.NotNil(t, r.Plan)
	assert.False(t, r.Plan.WholeBatch, "%+v", r.Plan)
	assert.LessOrEqual(t, r.Plan.PeakReserved, int64(1<<30))
	// Resident: the parameters and the running statistics the batch norms
	// read, no optimizer state.
	stats := int64(0)
	for _, b := range nn.Buffers(models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet18(1000))) {
		stats += b.Tensor.Type().Bytes()
	}
	assert.Equal(t, int64(2*4*(64+4*64+5*128+5*256+5*512)), stats, "bn1, 4 per layer, 3 downsample: 4800 channels")
	assert.Equal(t, int64(11_689_512*4)+stats, r.Plan.Persistent)
}

func TestEstimateResNet18CIFAR(t *testing.T) {
	code, stdout, stderr := runCLI("estimate", "--model", "resnet18-cifar", "--batch", "128", "--budget", "24GiB",
		"--optimizer", "sgd-momentum", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, int64(11_173_962), r.Params)
	assert.Equal(t, "float32[128 3 32 32]", r.Input)
	assert.Equal(t, r.ParamBytes, r.StateBytes, "one momentum buffer per parameter")
	assert.Contains(t, r.NotChunkable, "batch_norm in bn1")
	require.NotNil(t, r.Plan)
	assert.True(t, r.Plan.WholeBatch)
}

func itoa(n int) string { return strconv.Itoa(n) }

// report --run measures a Session's step on the CPU executor: a ResNet's
// training step (batch norm on the batch's statistics, the batch whole)
// and its inference in chunks (running statistics) peak where estimate
// predicts.
func TestResNetReportRunMatchesEstimate(t *testing.T) {
	for _, args := range [][]string{
		{"--model", "resnet18-cifar", "--batch", "2", "--budget", "1GiB"},
		{"--model", "resnet18-cifar", "--batch", "8", "--budget", "66MiB", "--mode", "infer"}, // 4 × 2
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			code, stdout, stderr := runCLI(append(append([]string{"estimate"}, args...), "--json")...)
			require.Equal(t, exitOK, code, stderr)
			var r report
			require.NoError(t, json.Unmarshal([]byte(stdout), &r))
			require.NotNil(t, r.Plan)
			code, stdout, stderr = runCLI(append(append([]string{"report"}, args...), "--run", "--json")...)
			require.Equal(t, exitOK, code, stderr)
			var m memReport
			require.NoError(t, json.Unmarshal([]byte(stdout), &m))
			require.NotNil(t, m.Measured)
			assert.Equal(t, r.Plan.PeakReserved, m.Measured.PeakReserved, "estimate's prediction is the Session's measured peak")
			assert.Equal(t, r.Plan.PeakAllocated, m.Measured.PeakAllocated)
			if r.Mode == "infer" {
				assert.Greater(t, r.Plan.NumChunks, 1, "inference chunks")
			}
		})
	}
}
