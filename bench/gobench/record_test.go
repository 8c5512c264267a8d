package main

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRecordRoundTrip: a record written as a JSON line reads back equal,
// so bench/run-gpu's Python summary sees what gobench measured.
func TestRecordRoundTrip(t *testing.T) {
	in := Record{Kind: "throughput", Model: "mlp", Batch: 1024, Optimizer: "adam", Params: 19_506_186,
		PlanSeconds: 0.012, Warmup: 3, Steps: 2, StepSeconds: []float64{0.01, 0.011}, MedianStepSeconds: 0.0105,
		StepsPerSecond: 95.2, SamplesPerSecond: 97_523, PredictedPeakReserved: 1 << 30, Overhead: 32 << 20,
		MeasuredPeakReserved: 1<<30 + 32<<20, DeviceUsedPeak: 2 << 30, Verified: true}
	var buf bytes.Buffer
	require.NoError(t, writeRecord(&buf, in))
	line := buf.Bytes()
	require.Equal(t, byte('\n'), line[len(line)-1])
	require.Equal(t, 1, bytes.Count(line, []byte{'\n'}))
	var out Record
	require.NoError(t, json.Unmarshal(line, &out))
	require.Equal(t, in, out)
}

// A tightness record's chunk lists and next-size fields read back equal;
// a throughput record carries none of them.
func TestTightnessRecordRoundTrip(t *testing.T) {
	in := Record{Kind: "tightness", Model: "gpt", Batch: 64, Seq: 256, Optimizer: "adamw", Budget: 8 << 30,
		Overhead: 32 << 20, Chunks: 4, ChunkSizes: []int{16, 16, 16, 16}, PredictedPeakReserved: 7 << 30,
		MeasuredPeakReserved: 7<<30 + 32<<20, NextChunks: 3, NextChunkSizes: []int{22, 21, 21},
		NextPeakReserved: 8<<30 + 100<<20, NextOutOfMemory: true, Verified: true, VerifySeconds: 1.5}
	var buf bytes.Buffer
	require.NoError(t, writeRecord(&buf, in))
	var out Record
	require.NoError(t, json.Unmarshal(buf.Bytes(), &out))
	require.Equal(t, in, out)
	var fields map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &fields))
	require.Equal(t, []any{16.0, 16.0, 16.0, 16.0}, fields["chunk_sizes"])
	require.Equal(t, true, fields["next_out_of_memory"])

	buf.Reset()
	require.NoError(t, writeRecord(&buf, Record{Kind: "throughput", Model: "conv", Batch: 256}))
	clear(fields)
	require.NoError(t, json.Unmarshal(buf.Bytes(), &fields))
	for _, k := range []string{"chunk_sizes", "next_chunks", "next_chunk_sizes", "next_peak_reserved", "next_out_of_memory"} {
		require.NotContains(t, fields, k)
	}
}
