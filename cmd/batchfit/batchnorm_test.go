package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// globalPool averages NCHW input over its height and width.
type globalPool struct{}

func (globalPool) Forward(x *lazy.Tensor) *lazy.Tensor { return x.Mean(2, 3) }
func (globalPool) Params() []*nn.Param                 { return nil }

// bnZooModel is a zoo entry for the tests only: conv, batch norm, relu,
// global average pooling and a linear head over 3×32×32 images, built with
// the options it is given (so --batchnorm reaches its batch norm).
var bnZooModel = zooModel{name: "bn-test", about: "conv, batch norm, relu, pool, linear", input: "image [3 32 32] float32",
	build: func(opt nn.Options, b, _ int, train bool, data *rand.Rand, _ adaptFunc) built {
		m := nn.NewSequential(nn.NewConv2d(opt, 3, 32, [2]int{3, 3}, false, lazy.ConvOptions{Padding: [2]int{1, 1}}),
			nn.NewBatchNorm2d(opt, 32, 1e-5, 0.1), nn.ReLU{}, globalPool{}, nn.NewLinear(opt, 32, 10, true))
		x := source(nil, data, []int{b, 3, 32, 32}, graph.Float32, 0)
		out := built{module: m, output: m.Forward(x)}
		if train {
			out.loss = out.output.CrossEntropy(source(x.Graph(), data, []int{b}, graph.Int64, 10), graph.ReduceMean)
		}
		return out
	}}

func bnConfig(budget int64, perChunk bool, policy precision.Policy) *estimateConfig {
	return &estimateConfig{model: bnZooModel, batch: 64, budget: budget, train: true, optimizer: "sgd", slots: 0,
		dtype: graph.Float32, policy: policy, perChunk: perChunk}
}

// estimate says which batch statistics the plan uses: whole-batch when
// the default step fits in one chunk (below that, the planner's error
// names the batch_norm node), per-chunk when --batchnorm per-chunk lets it
// run in chunks within the same smaller budget, in the text and the JSON,
// under a mixed precision policy too.
func TestEstimateBatchNorm(t *testing.T) {
	whole, err := estimate(bnConfig(1<<40, false, precision.FP32))
	require.NoError(t, err)
	require.True(t, whole.Plan.WholeBatch)
	assert.Equal(t, planner.WholeBatchStats, whole.BatchStats)
	var text bytes.Buffer
	writeText(&text, whole, true)
	assert.Contains(t, text.String(), "batch norm       whole-batch statistics: 1 batch_norm node normalises with the mean and variance of all 64 samples")

	budget := whole.Plan.PeakReserved / 2
	r, err := estimate(bnConfig(budget, false, precision.FP32))
	require.ErrorIs(t, err, graph.ErrNotChunkable)
	var ce *shapeinfer.ChunkError
	require.True(t, errors.As(err, &ce))
	assert.Equal(t, "batch_norm", ce.Op)
	require.NotNil(t, r.DoesNotFit)

	for _, policy := range []precision.Policy{precision.FP32, precision.BF16Mixed} {
		r, err = estimate(bnConfig(budget, true, policy))
		require.NoError(t, err, policy)
		require.False(t, r.Plan.WholeBatch, policy)
		assert.Equal(t, planner.PerChunkStats, r.BatchStats, policy)
		text.Reset()
		writeText(&text, r, true)
		assert.Contains(t, text.String(), "batch norm       per-chunk statistics: 1 batch_norm node normalises each of the", policy)
		var js bytes.Buffer
		require.NoError(t, writeJSON(&js, r))
		var back map[string]any
		require.NoError(t, json.Unmarshal(js.Bytes(), &back))
		assert.Equal(t, "per-chunk", back["batch_stats"], policy)
		assert.True(t, strings.HasPrefix(back["batch_norm"].(string), "per-chunk statistics"), policy)
	}

	// The flag reaches the configuration; models without batch norm say
	// nothing about it.
	c, err := parseEstimate([]string{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "--batchnorm", "per-chunk"})
	require.NoError(t, err)
	assert.True(t, c.perChunk)
	r, err = estimate(c)
	require.NoError(t, err)
	assert.Empty(t, r.BatchStats)
	text.Reset()
	writeText(&text, r, true)
	assert.NotContains(t, text.String(), "batch norm")
}
