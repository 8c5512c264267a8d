package progress

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// Off a terminal, each finished item is one plain line with the count
// and the time since the start; a nil Reporter writes nothing.
func TestPlainLines(t *testing.T) {
	var b strings.Builder
	r := New(&b, "calibrate", 3)
	assert.Nil(t, r.bar, "a strings.Builder is no terminal")
	clock := r.start
	r.now = func() time.Time { clock = clock.Add(1500 * time.Millisecond); return clock }
	r.Done("GEMMs")
	r.Done("launches")
	r.Finish()
	assert.Equal(t, "calibrate: 1/3 GEMMs (1.5s)\ncalibrate: 2/3 launches (3s)\n", b.String())

	var none *Reporter
	none.Done("x")
	none.Finish()
}

// A file that is not a terminal is no terminal.
func TestIsTerminal(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "out")
	assert.NoError(t, err)
	defer f.Close()
	assert.False(t, IsTerminal(f))
	assert.False(t, IsTerminal(&strings.Builder{}))
}
