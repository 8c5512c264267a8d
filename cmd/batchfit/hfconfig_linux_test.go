package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The largest configs --hf-config accepts plan within the bounds of
// every command that reads a file from outside: the most layers
// (maxHFLayers), and hf's largest widths and vocabulary, whose tensors
// could never be allocated; a config file past hf's 1 MiB is refused
// before it is read.
func TestHFConfigBounded(t *testing.T) {
	if raceEnabled {
		t.Skip("resource bounds are not measurable under the race detector")
	}
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
		return p
	}
	huge := make([]byte, 100<<20)
	for i := range huge {
		huge[i] = ' '
	}
	huge[0] = '{'
	huge[len(huge)-1] = '}'
	big := filepath.Join(dir, "big.json")
	require.NoError(t, os.WriteFile(big, huge, 0o644))
	cases := []struct {
		name, path string
		want       int
	}{
		{"deep", write("deep.json", `{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1024, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}`), exitOK},
		{"wide", write("wide.json", `{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1024, "hidden_size": 16777216, "num_attention_heads": 4096, "intermediate_size": 16777216, "vocab_size": 16777216}`), exitPlan},
		{"gpt2 wide", write("gpt2.json", `{"architectures": ["GPT2LMHeadModel"], "n_layer": 1024, "n_embd": 16777216, "n_head": 4096, "vocab_size": 16777216, "n_positions": 1073741824}`), exitPlan},
		{"100 MB", big, exitPlan},
	}
	long := write("long.json", `{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 512, "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 10, "max_position_embeddings": 1073741824}`)
	for _, c := range cases {
		code, stderr, wall, cpu, rss := runBounded(t, "estimate", "--hf-config", c.path, "--batch", "4", "--seq", "64", "--budget", "10GiB")
		t.Logf("%s: exit %d in %v (%v processor), peak RSS %d MiB", c.name, code, wall, cpu, rss>>20)
		assert.Equal(t, c.want, code, "%s: %s", c.name, stderr)
		assert.Less(t, rss, int64(hostileRSS), c.name)
		assert.Less(t, cpu, hostileCPU, c.name)
		assert.Less(t, wall, hostileWall, c.name)
	}
	// report --run of a model of 2³⁰ positions builds it at --seq only
	// (its rotary table would be 512 GiB at max_position_embeddings).
	code, stderr, _, cpu, rss := runBounded(t, "report", "--hf-config", long, "--batch", "2", "--seq", "16", "--budget", "1GiB", "--run")
	assert.Equal(t, exitOK, code, stderr)
	assert.Less(t, rss, int64(hostileRSS))
	assert.Less(t, cpu, hostileCPU)
}
