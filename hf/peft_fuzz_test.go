package hf_test

import (
	"errors"
	"testing"

	"github.com/batchfit/batchfit/hf"
)

// ParseAdapterConfig never panics, and every error it returns is one of
// the package's typed ones; a config it accepts has a rank, alpha,
// dropout and targets nn.LoRA accepts.
func FuzzParseAdapterConfig(f *testing.F) {
	f.Add([]byte(`{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}`))
	f.Add([]byte(`{"peft_type": "LORA", "r": 8.0, "lora_alpha": 16.5, "lora_dropout": 0.1, "target_modules": "q_proj"}`))
	f.Add([]byte(`{"peft_type": "LORA", "r": 1e300, "target_modules": [""]}`))
	f.Add([]byte(`{"r": -1, "rank_pattern": {"a": 2}, "use_dora": "yes"}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"target_modules": [".", "a..b"], "lora_dropout": 1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := hf.ParseAdapterConfig(b)
		if err != nil {
			if !errors.Is(err, hf.ErrConfig) && !errors.Is(err, hf.ErrUnsupported) && !errors.Is(err, hf.ErrTooLarge) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if err := c.LoRA.Check(); err != nil {
			t.Fatalf("accepted %s: %v", b, err)
		}
	})
}
