package data_test

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/data"
)

// randomTokens is n ids below vocab drawn from seed.
func randomTokens(seed uint64, n, vocab int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 1))
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(vocab))
	}
	return t
}

func narrow(t []uint32) []uint16 {
	out := make([]uint16, len(t))
	for i, v := range t {
		out[i] = uint16(v)
	}
	return out
}

// writeFile writes b to a file in a test directory.
func writeFile(t *testing.T, name string, b []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(path, b, 0o644))
	return path
}

// llmcFile is llm.c's layout written by hand, as dev/data/data_common.py's
// write_datafile lays it out: 256 int32 (magic, version, count, zeros),
// then the tokens.
func llmcFile(magic, version, count int32, tokens any) []byte {
	var b bytes.Buffer
	h := make([]int32, 256)
	h[0], h[1], h[2] = magic, version, count
	_ = binary.Write(&b, binary.LittleEndian, h)
	_ = binary.Write(&b, binary.LittleEndian, tokens)
	return b.Bytes()
}

func raw(tokens any) []byte {
	var b bytes.Buffer
	_ = binary.Write(&b, binary.LittleEndian, tokens)
	return b.Bytes()
}

// Every layout nanoGPT and llm.c write opens, detected or named, and
// reads back the tokens written, independently of WriteTokens; and
// WriteTokens writes the same bytes.
func TestOpenTokensFormats(t *testing.T) {
	wide := randomTokens(1, 1000, 128256)
	small := narrow(randomTokens(2, 1001, 50257))
	for _, c := range []struct {
		name   string
		bytes  []byte
		format data.Format
		layout data.Format
		want   []int
		write  *data.Tokens
	}{
		{"nanoGPT raw uint16, detected", raw(small), data.FormatAuto, data.FormatRaw16, ints16(small), data.Tokens16(small)},
		{"nanoGPT raw uint16, named", raw(small), data.FormatRaw16, data.FormatRaw16, ints16(small), data.Tokens16(small)},
		{"raw uint32, named", raw(wide), data.FormatRaw32, data.FormatRaw32, ints32(wide), data.Tokens32(wide)},
		{"llm.c gpt-2, detected", llmcFile(20240520, 1, int32(len(small)), small), data.FormatAuto, data.FormatLLMC, ints16(small), data.Tokens16(small)},
		{"llm.c gpt-2, named", llmcFile(20240520, 1, int32(len(small)), small), data.FormatLLMC, data.FormatLLMC, ints16(small), data.Tokens16(small)},
		{"llm.c llama-3, detected", llmcFile(20240801, 7, int32(len(wide)), wide), data.FormatAuto, data.FormatLLMC, ints32(wide), data.Tokens32(wide)},
		{"llm.c, no tokens", llmcFile(20240520, 1, 0, []uint16{}), data.FormatAuto, data.FormatLLMC, nil, data.Tokens16(nil)},
		{"empty raw file", nil, data.FormatAuto, data.FormatRaw16, nil, data.Tokens16(nil)},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, err := data.OpenTokens(writeFile(t, "tokens.bin", c.bytes), c.format)
			require.NoError(t, err)
			assert.Equal(t, c.layout, f.Format)
			require.Equal(t, len(c.want), f.Len())
			for i, w := range c.want {
				if f.At(i) != w {
					t.Fatalf("token %d: %d, want %d", i, f.At(i), w)
				}
			}
			require.NoError(t, f.Close())
			require.NoError(t, f.Close(), "closing twice")

			var b bytes.Buffer
			require.NoError(t, data.WriteTokens(&b, c.write, c.layout))
			assert.Equal(t, c.bytes, nilIfEmpty(b.Bytes()))
		})
	}
}

func nilIfEmpty(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return b
}

func ints16(t []uint16) []int {
	out := make([]int, len(t))
	for i, v := range t {
		out[i] = int(v)
	}
	return out
}

func ints32(t []uint32) []int {
	out := make([]int, len(t))
	for i, v := range t {
		out[i] = int(v)
	}
	return out
}

// Hostile files: every one is a typed *FileError naming the path, none
// blocks or maps garbage.
func TestOpenTokensHostile(t *testing.T) {
	small := narrow(randomTokens(3, 100, 50257))
	good := llmcFile(20240520, 1, 100, small)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(fifo, link))
	for _, c := range []struct {
		name   string
		path   string
		format data.Format
		kind   error
	}{
		{"a directory", dir, data.FormatAuto, data.ErrNotRegular},
		{"a FIFO (would block a plain open)", fifo, data.FormatAuto, data.ErrNotRegular},
		{"a link to a FIFO", link, data.FormatAuto, data.ErrNotRegular},
		{"a character device", os.DevNull, data.FormatAuto, data.ErrNotRegular},
		{"missing", filepath.Join(dir, "none.bin"), data.FormatAuto, os.ErrNotExist},
		{"odd raw size", writeFile(t, "odd.bin", []byte{1, 2, 3}), data.FormatAuto, data.ErrFormat},
		{"raw uint32 of 6 bytes", writeFile(t, "six.bin", []byte{1, 2, 3, 4, 5, 6}), data.FormatRaw32, data.ErrFormat},
		{"llm.c truncated", writeFile(t, "short.bin", good[:len(good)-2]), data.FormatAuto, data.ErrSize},
		{"llm.c with trailing bytes", writeFile(t, "long.bin", append(good, 0, 0)), data.FormatAuto, data.ErrSize},
		{"llm.c header cut short", writeFile(t, "head.bin", good[:100]), data.FormatAuto, data.ErrSize},
		{"llm.c magic, magic only", writeFile(t, "magic.bin", good[:4]), data.FormatAuto, data.ErrSize},
		{"llm.c count beyond the file", writeFile(t, "count.bin", llmcFile(20240520, 1, 1<<30, small)), data.FormatAuto, data.ErrSize},
		{"llm.c negative count", writeFile(t, "neg.bin", llmcFile(20240520, 1, -5, small)), data.FormatAuto, data.ErrSize},
		{"llm.c unknown version", writeFile(t, "v2.bin", llmcFile(20240520, 2, 100, small)), data.FormatAuto, data.ErrFormat},
		{"llm.c llama magic, gpt-2 version", writeFile(t, "mix.bin", llmcFile(20240801, 1, 100, small)), data.FormatAuto, data.ErrFormat},
		{"llm.c asked of a raw file", writeFile(t, "raw.bin", raw(small)), data.FormatLLMC, data.ErrFormat},
		{"an unknown format", writeFile(t, "fmt.bin", raw(small)), data.Format(9), data.ErrOptions},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, err := data.OpenTokens(c.path, c.format)
			require.ErrorIs(t, err, c.kind)
			require.Nil(t, f)
			var fe *data.FileError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, c.path, fe.Path)
			assert.True(t, strings.Contains(err.Error(), c.path))
		})
	}
}

// A raw file opened with FormatRaw16 is read raw even when its first
// tokens spell llm.c's magic (a vocabulary above 55,432 can).
func TestRawFormatIgnoresMagic(t *testing.T) {
	toks := []uint16{0xd888, 0x0134, 1, 0, 7, 7} // 20240520 = 0x0134d888 little-endian, then tokens
	f, err := data.OpenTokens(writeFile(t, "raw.bin", raw(toks)), data.FormatRaw16)
	require.NoError(t, err)
	defer f.Close()
	assert.Equal(t, len(toks), f.Len())
	assert.Equal(t, 0xd888, f.At(0))
	_, err = data.OpenTokens(writeFile(t, "raw.bin", raw(toks)), data.FormatAuto)
	require.ErrorIs(t, err, data.ErrSize, "detected as llm.c, whose header does not hold")
}

// byteEncoder is a stand-in tokenizer: one id per byte, plus 300 to
// make ids wider than a byte.
type byteEncoder struct{ offset int }

func (e byteEncoder) Encode(s string) []int {
	ids := make([]int, len(s))
	for i := range len(s) {
		ids[i] = int(s[i]) + e.offset
	}
	return ids
}

// Text through an encoder: documents in order, each followed by the
// end-of-text id; 16-bit storage unless an id needs more.
func TestEncodeTexts(t *testing.T) {
	tk, err := data.EncodeTexts(byteEncoder{300}, []string{"ab", "c"}, 50256)
	require.NoError(t, err)
	assert.Equal(t, 2, tk.Width())
	got := make([]int, tk.Len())
	for i := range got {
		got[i] = tk.At(i)
	}
	assert.Equal(t, []int{397, 398, 50256, 399, 50256}, got)

	tk, err = data.EncodeTexts(byteEncoder{70000}, []string{"a"}, -1)
	require.NoError(t, err)
	assert.Equal(t, 4, tk.Width())
	assert.Equal(t, 1, tk.Len())
	assert.Equal(t, 70097, tk.At(0))

	_, err = data.EncodeTexts(byteEncoder{-200}, []string{"a"}, -1)
	require.ErrorIs(t, err, data.ErrToken)
	_, err = data.EncodeTexts(nil, nil, -1)
	require.ErrorIs(t, err, data.ErrOptions)

	var b bytes.Buffer
	require.ErrorIs(t, data.WriteTokens(&b, data.Tokens32([]uint32{1}), data.FormatRaw16), data.ErrOptions)
}

// Windows cut the stream as a next-token loader must: sample i's inputs
// are tokens [i·stride, i·stride+seq), its targets the same shifted by
// one; the count is every full window.
func TestWindows(t *testing.T) {
	toks := narrow(randomTokens(4, 103, 1000))
	for _, c := range []struct{ seq, stride, n int }{{10, 0, 10}, {10, 10, 10}, {10, 5, 19}, {102, 0, 1}, {103, 0, 0}, {1, 0, 102}} {
		w, err := data.NewWindows(data.Tokens16(toks), c.seq, data.WindowOptions{Stride: c.stride, Vocab: 1000})
		require.NoError(t, err)
		require.Equal(t, c.n, w.Len(), "seq %d stride %d", c.seq, c.stride)
		stride := c.stride
		if stride == 0 {
			stride = c.seq
		}
		in, tg := make([]int64, c.seq), make([]int64, c.seq)
		for i := range w.Len() {
			require.NoError(t, w.Fill(i, []data.Slot{{I: in}, {I: tg}}))
			for j := range c.seq {
				require.Equal(t, int64(toks[i*stride+j]), in[j])
				require.Equal(t, int64(toks[i*stride+j+1]), tg[j])
			}
		}
	}
	toks[57] = 1000
	w, err := data.NewWindows(data.Tokens16(toks), 10, data.WindowOptions{Vocab: 1000})
	require.NoError(t, err)
	in, tg := make([]int64, 10), make([]int64, 10)
	require.NoError(t, w.Fill(4, []data.Slot{{I: in}, {I: tg}}))
	require.ErrorIs(t, w.Fill(5, []data.Slot{{I: in}, {I: tg}}), data.ErrToken, "token 57 lies in window 5")
	toks[57], toks[60] = 0, 1000
	require.ErrorIs(t, w.Fill(5, []data.Slot{{I: in}, {I: tg}}), data.ErrToken, "the last target too")
	require.ErrorIs(t, w.Fill(10, []data.Slot{{I: in}, {I: tg}}), data.ErrOptions)

	for _, bad := range []struct{ seq, stride, vocab int }{{0, 0, 0}, {4, -1, 0}, {4, 0, -1}} {
		_, err := data.NewWindows(data.Tokens16(toks), bad.seq, data.WindowOptions{Stride: bad.stride, Vocab: bad.vocab})
		require.ErrorIs(t, err, data.ErrOptions)
	}
}
