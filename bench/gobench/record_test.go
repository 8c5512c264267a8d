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
