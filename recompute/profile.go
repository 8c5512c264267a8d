package recompute

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
)

// MaxProfileBytes caps a profile file: one is a few hundred bytes.
const MaxProfileBytes = 64 << 10

// ErrProfile marks a profile file that cannot be used: too large, not
// JSON, unknown fields, or figures that are not positive finite numbers.
var ErrProfile = errors.New("recompute: bad profile")

// Validate checks that every rate is a positive finite number.
func (p Profile) Validate() error {
	for _, f := range []struct {
		name string
		v    float64
		opt  bool
	}{{"matmul_flops", p.MatMulFLOPS, false}, {"tf32_flops", p.TF32FLOPS, true},
		{"half_flops", p.HalfFLOPS, true}, {"half_unaligned_flops", p.HalfUnalignedFLOPS, true},
		{"half_conv_flops", p.HalfConvFLOPS, true},
		{"attention_flops", p.AttentionFLOPS, true}, {"half_attention_flops", p.HalfAttentionFLOPS, true},
		{"vector_flops", p.VectorFLOPS, false},
		{"bandwidth", p.Bandwidth, false}, {"launch", p.Launch, true}, {"host_bandwidth", p.HostBandwidth, true}} {
		if f.opt && f.v == 0 {
			continue
		}
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v <= 0 || (f.name == "launch" && f.v > 1) {
			return fmt.Errorf("%w: %s is %v", ErrProfile, f.name, f.v)
		}
	}
	return nil
}

// ReadProfile reads a JSON profile (as WriteProfile writes it) from r,
// at most MaxProfileBytes, rejecting unknown fields and trailing data.
func ReadProfile(r io.Reader) (Profile, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxProfileBytes+1))
	if err != nil {
		return Profile{}, fmt.Errorf("%w: %v", ErrProfile, err)
	}
	if len(data) > MaxProfileBytes {
		return Profile{}, fmt.Errorf("%w: more than %d bytes", ErrProfile, MaxProfileBytes)
	}
	var p Profile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return Profile{}, fmt.Errorf("%w: %v", ErrProfile, err)
	}
	if dec.More() {
		return Profile{}, fmt.Errorf("%w: trailing data after the profile", ErrProfile)
	}
	if len(p.Sources) > 64 {
		return Profile{}, fmt.Errorf("%w: %d sources (at most 64)", ErrProfile, len(p.Sources))
	}
	if err := p.Validate(); err != nil {
		return Profile{}, err
	}
	return p, nil
}

// LoadProfile reads a profile file, or a built-in profile by name
// ("default", "h100").
func LoadProfile(name string) (Profile, error) {
	if p, ok := Profiles()[name]; ok {
		return p, nil
	}
	f, err := os.Open(name)
	if err != nil {
		return Profile{}, fmt.Errorf("%w: %v (built-in profiles: default, h100)", ErrProfile, err)
	}
	defer f.Close()
	return ReadProfile(f)
}

// WriteProfile writes p as indented JSON.
func WriteProfile(w io.Writer, p Profile) error {
	if err := p.Validate(); err != nil {
		return err
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(p)
}
