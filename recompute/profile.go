package recompute

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/batchfit/batchfit/internal/safefile"
)

// MaxProfileBytes caps a profile file: one is a few hundred bytes.
const MaxProfileBytes = 64 << 10

// ErrProfile marks a profile file that cannot be used: too large, not
// JSON, unknown fields, or figures outside the plausible bounds below.
var ErrProfile = errors.New("recompute: bad profile")

// A profile's plausible bounds: any device's rates, bandwidths and launch
// cost lie within them by orders of magnitude either way (the H100's FP32
// GEMM is 5e13 flop/s, a laptop core's 1e10; HBM3 streams 3e12 B/s, PCIe
// 3 x1 1e9), and within them a step's predicted time stays far inside a
// time.Duration.
const (
	MinRate, MaxRate           = 1e6, 1e18 // flop/s
	MinBandwidth, MaxBandwidth = 1e6, 1e15 // bytes/s
	MinLaunch, MaxLaunch       = 1e-9, 1.0 // seconds
)

// Validate checks that every figure is a finite number within the
// plausible bounds (MinRate…MaxRate and so on; the optional ones may be
// 0, for "not measured").
func (p Profile) Validate() error {
	const rate, bandwidth, launch = 0, 1, 2
	bounds := [3][2]float64{{MinRate, MaxRate}, {MinBandwidth, MaxBandwidth}, {MinLaunch, MaxLaunch}}
	for _, f := range []struct {
		name string
		v    float64
		opt  bool
		kind int
	}{{"matmul_flops", p.MatMulFLOPS, false, rate}, {"tf32_flops", p.TF32FLOPS, true, rate},
		{"half_flops", p.HalfFLOPS, true, rate}, {"half_unaligned_flops", p.HalfUnalignedFLOPS, true, rate},
		{"half_conv_flops", p.HalfConvFLOPS, true, rate},
		{"attention_flops", p.AttentionFLOPS, true, rate}, {"half_attention_flops", p.HalfAttentionFLOPS, true, rate},
		{"vector_flops", p.VectorFLOPS, false, rate},
		{"bandwidth", p.Bandwidth, false, bandwidth}, {"launch", p.Launch, true, launch},
		{"host_bandwidth", p.HostBandwidth, true, bandwidth}, {"host_update_rate", p.HostUpdateRate, true, rate}} {
		if f.opt && f.v == 0 {
			continue
		}
		if b := bounds[f.kind]; !(f.v >= b[0] && f.v <= b[1]) { // NaN fails too
			return fmt.Errorf("%w: %s is %v, outside the plausible %g to %g", ErrProfile, f.name, f.v, b[0], b[1])
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
// ("default", "h100", "h200").
func LoadProfile(name string) (Profile, error) {
	if p, ok := Profiles()[name]; ok {
		return p, nil
	}
	// A profile file is hostile input: a regular file of at most
	// MaxProfileBytes (a FIFO or /dev/zero is refused at once).
	f, _, err := safefile.Open(name, MaxProfileBytes)
	if err != nil {
		return Profile{}, fmt.Errorf("%w: %w (built-in profiles: default, h100, h200)", ErrProfile, err)
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
