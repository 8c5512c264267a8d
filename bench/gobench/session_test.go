package main

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/nn"
)

// rebuild makes the graph build makes, over the given data: same
// signature (ops, shapes, attributes), and the data in the input nodes.
func TestRebuildMatchesBuild(t *testing.T) {
	ms, err := benchModels(config{models: "mlp,gpt,conv,resnet50,llama", gptLayers: 1, gptSeq: 8, gptBatch: 2, mlpBatch: 4, convBatch: 2,
		resnetBatch: 2, resnetSize: 32, llamaConfig: "llama-tiny", llamaSeq: 8, llamaBatch: 2})
	require.NoError(t, err)
	for _, m := range ms {
		mod := m.module(nn.Seed(1))
		loss, in := m.build(mod, m.batch, rand.New(rand.NewPCG(1, 2)))
		require.NoError(t, loss.Err())
		data := []tensor.Tensor{in[0].Value(), in[1].Value()}
		again, err := rebuild(m, mod, data)
		require.NoError(t, err, m.name)
		require.Equal(t, loss.Graph().IR().Signature(), again.Graph().IR().Signature(), m.name)
		require.Same(t, data[0], again.Graph().IR().Node(0).Value, "%s: the first input holds the data", m.name)
	}
	_, err = rebuild(benchModel{name: "nope"}, nil, nil)
	require.Error(t, err)
}

// The llama model's step over placeholders (what the executor loop
// compiles once) is the step over data (what it feeds): one signature,
// the inputs at the same places.
func TestLlamaPlaceholderStepMatchesData(t *testing.T) {
	ms, err := benchModels(config{models: "llama,llama-written", llamaConfig: "llama-tiny", llamaSeq: 16, llamaBatch: 3})
	require.NoError(t, err)
	require.Len(t, ms, 2)
	for _, m := range ms {
		placeholderMatchesData(t, m)
	}
	_, err = benchModels(config{models: "llama", llamaConfig: "llama2"})
	require.Error(t, err)
	for _, name := range []string{"llama-0.8b", "llama-8x1024"} {
		_, err = benchModels(config{models: "llama-written", llamaConfig: name, llamaSeq: 16, llamaBatch: 1})
		require.NoError(t, err, name)
	}
}

func placeholderMatchesData(t *testing.T, m benchModel) {
	mod := m.module(nn.Seed(1))
	withData, in := m.build(mod, m.batch, rand.New(rand.NewPCG(1, 2)))
	require.NoError(t, withData.Err())
	shapeOnly, pin := m.build(mod, m.batch, nil)
	require.NoError(t, shapeOnly.Err())
	require.Equal(t, withData.Graph().IR().Signature(), shapeOnly.Graph().IR().Signature())
	for i := range in {
		require.Equal(t, in[i].ID(), pin[i].ID())
	}
}
