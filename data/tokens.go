package data

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"syscall"
	"unsafe"
)

// Format is a token file's layout.
type Format int

const (
	// FormatAuto detects the layout: llm.c's when the file starts with one
	// of llm.c's magic numbers (its header must then hold), nanoGPT's raw
	// uint16 tokens otherwise. A headerless file of 32-bit tokens cannot
	// be told from 16-bit ones: open it with FormatRaw32.
	FormatAuto Format = iota
	// FormatRaw16 is nanoGPT's prepare.py output: little-endian uint16
	// tokens and nothing else (np.memmap(path, dtype=np.uint16)).
	FormatRaw16
	// FormatRaw32 is the same with uint32 tokens.
	FormatRaw32
	// FormatLLMC is llm.c's dev/data format: a header of 256 little-endian
	// int32 (magic, version, token count, zeros), then the tokens: uint16
	// for magic 20240520 version 1 (GPT-2), uint32 for magic 20240801
	// version 7 (Llama 3).
	FormatLLMC
)

func (f Format) String() string {
	switch f {
	case FormatAuto:
		return "auto"
	case FormatRaw16:
		return "raw uint16"
	case FormatRaw32:
		return "raw uint32"
	case FormatLLMC:
		return "llm.c"
	}
	return fmt.Sprintf("Format(%d)", int(f))
}

// llm.c's header: 256 int32, then the tokens.
const headerBytes = 256 * 4

// llmcKind is a header llm.c writes (dev/data/data_common.py's
// HEADERS_INFO): its magic, its version and its tokens' width in bytes.
type llmcKind struct {
	magic, version int32
	width          int
}

var llmcKinds = []llmcKind{
	{20240520, 1, 2}, // "gpt-2": uint16
	{20240801, 7, 4}, // "llama-3": uint32
}

// Tokens is a stream of token ids of 16 or 32 bits each, in memory or
// mapped from a file (OpenTokens). Its methods may be called from several
// goroutines at once.
type Tokens struct {
	u16 []uint16
	u32 []uint32
}

// Tokens16 is a stream over t (not copied).
func Tokens16(t []uint16) *Tokens { return &Tokens{u16: t} }

// Tokens32 is a stream over t (not copied).
func Tokens32(t []uint32) *Tokens { return &Tokens{u32: t} }

// Len is the number of tokens.
func (t *Tokens) Len() int {
	if t.u32 != nil {
		return len(t.u32)
	}
	return len(t.u16)
}

// Width is the bytes of one token: 2 or 4.
func (t *Tokens) Width() int {
	if t.u32 != nil {
		return 4
	}
	return 2
}

// At is token i. On a mapped file it reads the mapping: a file truncated
// under it faults (SIGBUS) outside the loader, which reads the mapping
// with faults turned into ErrChanged.
func (t *Tokens) At(i int) int {
	if t.u32 != nil {
		return int(t.u32[i])
	}
	return int(t.u16[i])
}

// widen writes tokens off…off+len(dst)−1 into dst as int64 and returns
// the largest. The maximum is kept in the tokens' own width, which the
// compiler keeps in a register beside the stores.
func (t *Tokens) widen(dst []int64, off int) int64 {
	if t.u32 != nil {
		src := t.u32[off : off+len(dst)]
		dst = dst[:len(src)]
		var m uint32
		for i, v := range src {
			dst[i] = int64(v)
			m = max(m, v)
		}
		return int64(m)
	}
	src := t.u16[off : off+len(dst)]
	dst = dst[:len(src)]
	var m uint16
	for i, v := range src {
		dst[i] = int64(v)
		m = max(m, v)
	}
	return int64(m)
}

// TokenFile is a token file mapped into memory (OpenTokens): its Tokens
// read the mapping, so opening a file of any size takes no time and no
// heap, and pages are read as batches need them.
type TokenFile struct {
	*Tokens
	Path   string
	Format Format // the layout read: FormatRaw16, FormatRaw32 or FormatLLMC
	mapped []byte
}

// OpenTokens maps the token file at path, of layout format (FormatAuto:
// detected). The file must be a regular file (opened without blocking, so
// a FIFO cannot hang the open, and checked once open), a whole number of
// tokens, and for llm.c's format exactly the size its header gives.
// Errors are *FileError wrapping ErrNotRegular, ErrFormat or ErrSize (or
// the operating system's). Close unmaps it; its Tokens must not be used
// after.
func OpenTokens(path string, format Format) (*TokenFile, error) {
	fail := func(err error) (*TokenFile, error) { return nil, &FileError{Path: path, Err: err} }
	if format < FormatAuto || format > FormatLLMC {
		return fail(errorf(ErrOptions, "unknown format %d", int(format)))
	}
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		return fail(errorf(ErrFormat, "token files are little-endian and this host is not"))
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fail(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fail(err)
	}
	if !fi.Mode().IsRegular() {
		return fail(errorf(ErrNotRegular, "%s", fi.Mode().Type()))
	}
	size := fi.Size()
	var head [12]byte
	n, err := io.ReadFull(f, head[:])
	if err != nil && err != io.ErrUnexpectedEOF && err != io.EOF {
		return fail(err)
	}
	layout, offset, width, err := detect(format, head[:n], size)
	if err != nil {
		return fail(err)
	}
	if size > math.MaxInt {
		return fail(errorf(ErrSize, "%d bytes do not fit this host's address space", size))
	}
	m, err := mapFile(f, size)
	if err != nil {
		return fail(err)
	}
	tf := &TokenFile{Tokens: &Tokens{}, Path: path, Format: layout, mapped: m}
	body := m[offset:]
	count := len(body) / width
	if count > 0 {
		p := unsafe.Pointer(unsafe.SliceData(body)) // page-aligned, and the header keeps it so
		if width == 4 {
			tf.u32 = unsafe.Slice((*uint32)(p), count)
		} else {
			tf.u16 = unsafe.Slice((*uint16)(p), count)
		}
	} else if width == 4 {
		tf.u32 = []uint32{}
	}
	return tf, nil
}

// detect checks a file of size bytes starting with head against format
// and says its layout, where its tokens start and their width.
func detect(format Format, head []byte, size int64) (layout Format, offset int64, width int, err error) {
	var kind *llmcKind
	if len(head) >= 4 {
		magic := int32(binary.LittleEndian.Uint32(head))
		for i := range llmcKinds {
			if llmcKinds[i].magic == magic {
				kind = &llmcKinds[i]
			}
		}
	}
	switch {
	case format == FormatLLMC && kind == nil:
		return 0, 0, 0, errorf(ErrFormat, "no llm.c magic number (want 20240520 or 20240801)")
	case format == FormatLLMC, format == FormatAuto && kind != nil:
		if size < headerBytes || len(head) < 12 {
			return 0, 0, 0, errorf(ErrSize, "%d bytes: llm.c's header alone is %d", size, headerBytes)
		}
		version, count := int32(binary.LittleEndian.Uint32(head[4:])), int32(binary.LittleEndian.Uint32(head[8:]))
		if version != kind.version {
			return 0, 0, 0, errorf(ErrFormat, "llm.c magic %d with version %d (want %d)", kind.magic, version, kind.version)
		}
		if count < 0 {
			return 0, 0, 0, errorf(ErrSize, "llm.c header counts %d tokens", count)
		}
		if want := headerBytes + int64(count)*int64(kind.width); size != want {
			return 0, 0, 0, errorf(ErrSize, "%d bytes; the header's %d tokens of %d bytes make %d", size, count, kind.width, want)
		}
		return FormatLLMC, headerBytes, kind.width, nil
	case format == FormatRaw32:
		if size%4 != 0 {
			return 0, 0, 0, errorf(ErrFormat, "%d bytes are not a whole number of uint32 tokens", size)
		}
		return FormatRaw32, 0, 4, nil
	default: // FormatRaw16, or FormatAuto without a header
		if size%2 != 0 {
			return 0, 0, 0, errorf(ErrFormat, "%d bytes are not a whole number of uint16 tokens", size)
		}
		return FormatRaw16, 0, 2, nil
	}
}

// Close unmaps the file.
func (f *TokenFile) Close() error {
	m := f.mapped
	f.mapped, f.Tokens = nil, &Tokens{}
	return unmap(m)
}

// WriteTokens writes t to w in format: FormatRaw16 or FormatLLMC for
// 16-bit streams (llm.c's GPT-2 header), FormatRaw32 or FormatLLMC for
// 32-bit ones (llm.c's Llama 3 header). llm.c's header counts at most
// 2³¹−1 tokens.
func WriteTokens(w io.Writer, t *Tokens, format Format) error {
	wide := t.Width() == 4
	switch {
	case format == FormatRaw16 && wide, format == FormatRaw32 && !wide:
		return errorf(ErrOptions, "%s for %d-bit tokens", format, 8*t.Width())
	case format == FormatLLMC:
		if t.Len() > math.MaxInt32 {
			return errorf(ErrOptions, "llm.c's header counts at most %d tokens, not %d", math.MaxInt32, t.Len())
		}
		kind := llmcKinds[0]
		if wide {
			kind = llmcKinds[1]
		}
		var h [headerBytes]byte
		binary.LittleEndian.PutUint32(h[0:], uint32(kind.magic))
		binary.LittleEndian.PutUint32(h[4:], uint32(kind.version))
		binary.LittleEndian.PutUint32(h[8:], uint32(t.Len()))
		if _, err := w.Write(h[:]); err != nil {
			return err
		}
	case format != FormatRaw16 && format != FormatRaw32:
		return errorf(ErrOptions, "cannot write format %s", format)
	}
	if wide {
		return binary.Write(w, binary.LittleEndian, t.u32)
	}
	return binary.Write(w, binary.LittleEndian, t.u16)
}

// Encoder turns text into token ids: the seam where a tokenizer plugs
// in (package tokenizer's, or any other with this method).
type Encoder interface {
	Encode(text string) []int
}

// EncodeTexts runs each document through enc and returns the stream of
// their tokens, each document followed by eot when eot ≥ 0 (GPT-2's
// <|endoftext|>, 50256, after each document as nanoGPT's prepare.py puts
// it; llm.c's scripts put it before each, which shifts the stream by one
// token). The
// stream is 16-bit when every id fits, 32-bit otherwise; an id outside
// [0, 2³²) is ErrToken. WriteTokens saves it for OpenTokens to map.
func EncodeTexts(enc Encoder, docs []string, eot int) (*Tokens, error) {
	if enc == nil {
		return nil, errorf(ErrOptions, "nil encoder")
	}
	if eot > math.MaxUint32 {
		return nil, errorf(ErrToken, "end-of-text id %d", eot)
	}
	var ids []uint32
	wide := eot > math.MaxUint16
	for d, doc := range docs {
		for _, id := range enc.Encode(doc) {
			if id < 0 || id > math.MaxUint32 {
				return nil, errorf(ErrToken, "document %d: id %d", d, id)
			}
			wide = wide || id > math.MaxUint16
			ids = append(ids, uint32(id))
		}
		if eot >= 0 {
			ids = append(ids, uint32(eot))
		}
	}
	if wide {
		return Tokens32(ids), nil
	}
	narrow := make([]uint16, len(ids))
	for i, id := range ids {
		narrow[i] = uint16(id)
	}
	return Tokens16(narrow), nil
}
