package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/batchfit/batchfit/internal/safefile"
	"github.com/batchfit/batchfit/memviz"
)

// Snapshot file formats.
const (
	formatPickle = "pickle" // torch.cuda.memory._snapshot() pickled, for pytorch.org/memory_viz
	formatPprof  = "pprof"  // gzipped pprof profile, for go tool pprof
	formatFolded = "folded" // folded stacks, for flamegraph.pl and speedscope
)

var formats = []string{formatPickle, formatPprof, formatFolded}

// File errors. A *fileError wraps errFileKind, or memviz.ErrTooLarge for a
// file over maxFile, or safefile.ErrNotRegular for a FIFO, a device or a
// directory (with syscall.EISDIR), or the os error (errors.Is
// fs.ErrNotExist, fs.ErrPermission), or the reader's *memviz.FormatError
// (memviz.ErrFormat, with io.ErrUnexpectedEOF for a truncated file and
// memviz.ErrTooLarge for one past the reader's caps).
var errFileKind = errors.New("wrong kind of snapshot file")

// fileError is a snapshot file that could not be read or written.
type fileError struct {
	Path   string
	Format string // what it was read as, "" when it was not opened
	How    string // what said so: "by content", "by name", "as text", "as binary"
	Err    error
}

func (e *fileError) Error() string {
	if e.Format == "" {
		return fmt.Sprintf("%s: %v", e.Path, e.Err)
	}
	return fmt.Sprintf("%s (read as %s, %s): %v", e.Path, e.Format, e.How, e.Err)
}

func (e *fileError) Unwrap() error { return e.Err }

// maxFile bounds what the CLI reads, from fstat before a byte is read
// (standard input: as it is read): 256 MiB. Within it every reader keeps
// to its own caps (memviz's), which hold a command to about a gigabyte.
const maxFile = 256 << 20

// extensions are the file-name endings that tell each format, compared
// without case.
var extensions = []struct {
	format string
	ends   []string
}{
	{formatPickle, []string{".pickle", ".pkl"}},
	{formatPprof, []string{".pb.gz", ".pprof", ".pb"}},
	{formatFolded, []string{".folded", ".collapsed", ".txt"}},
	{formatHTML, []string{".html", ".htm"}},
}

// formatOfName is the format a file name's extension says, or "".
func formatOfName(path string) string {
	name := strings.ToLower(filepath.Base(path))
	for _, e := range extensions {
		for _, end := range e.ends {
			if strings.HasSuffix(name, end) {
				return e.format
			}
		}
	}
	return ""
}

// knownExtensions lists the endings by format, for messages:
// ".pickle or .pkl (pickle), ….".
func knownExtensions() string {
	var parts []string
	for _, e := range extensions {
		ends := strings.Join(e.ends[:len(e.ends)-1], ", ") + " or " + e.ends[len(e.ends)-1]
		parts = append(parts, ends+" ("+e.format+")")
	}
	return strings.Join(parts, "; ")
}

// sniff is the format the content says: a pickle of protocol 2 or later
// starts with the PROTO opcode 0x80, a gzipped pprof profile with the gzip
// magic; other text is read as folded stacks, other binary as pprof. The
// extension decides where the content does not (an older protocol's
// pickle, an uncompressed profile). how says which decided.
func sniff(path string, head []byte) (format, how string) {
	switch {
	case len(head) > 0 && head[0] == 0x80:
		return formatPickle, "by content"
	case bytes.HasPrefix(head, []byte{0x1f, 0x8b}):
		return formatPprof, "by content"
	}
	if f := formatOfName(path); f != "" && f != formatHTML { // a page is no snapshot to read
		return f, "by name"
	}
	if utf8.Valid(head) {
		return formatFolded, "as text"
	}
	return formatPprof, "as binary"
}

// snapshotFile is a snapshot file read back: a pickle gives blocks and
// segments, folded stacks and pprof give stacks only.
type snapshotFile struct {
	path   string
	format string
	how    string           // what decided the format (see sniff)
	snap   *memviz.Snapshot // pickle
	stacks []memviz.StackBytes
}

// Stacks is the file's stacks: a pickle's blocks summed by stack (worked
// out on first use), the stacks of the other formats.
func (f *snapshotFile) Stacks() []memviz.StackBytes {
	if f.stacks == nil && f.snap != nil {
		f.stacks = memviz.Stacks(*f.snap, nil)
	}
	return f.stacks
}

// readSnapshotFile reads path (or standard input for "-") in the format
// its content or name says, streaming it into the reader. With only set,
// a file in another format is refused (errFileKind, why) once its first
// bytes have said so, before it is parsed. Every error is a *fileError.
func readSnapshotFile(path string, stdin io.Reader, only, why string) (*snapshotFile, error) {
	r, closeFile, err := openInput(path, stdin)
	if err != nil {
		return nil, &fileError{Path: path, Err: err}
	}
	defer closeFile()
	br := bufio.NewReaderSize(r, 64<<10)
	head, err := br.Peek(512)
	if err != nil && err != io.EOF && !errors.Is(err, bufio.ErrBufferFull) {
		return nil, &fileError{Path: path, Err: err}
	}
	f := &snapshotFile{path: path}
	f.format, f.how = sniff(path, head)
	fail := func(err error) (*snapshotFile, error) {
		return nil, &fileError{Path: path, Format: f.format, How: f.how, Err: err}
	}
	if len(head) == 0 {
		return fail(&memviz.FormatError{Format: f.format, Offset: -1, Msg: "empty file", Err: io.ErrUnexpectedEOF})
	}
	if only != "" && f.format != only {
		return fail(fmt.Errorf("%w: %s; %s files hold stacks only", errFileKind, why, f.format))
	}
	// Standard input has no fstat: one byte past maxFile is an error.
	lr := &io.LimitedReader{R: br, N: maxFile + 1}
	switch f.format {
	case formatPickle:
		var s memviz.Snapshot
		if s, err = memviz.ReadPickle(lr); err == nil {
			f.snap = &s
		}
	case formatPprof:
		f.stacks, err = memviz.ReadPprof(lr)
	case formatFolded:
		f.stacks, err = memviz.ReadFolded(lr)
	}
	if lr.N <= 0 {
		return fail(fmt.Errorf("%w: more than %d bytes", memviz.ErrTooLarge, maxFile))
	}
	if err != nil {
		return fail(err)
	}
	return f, nil
}

// openInput opens path as hostile input (safefile: a regular file, of at
// most maxFile bytes by fstat, opened without blocking), or returns stdin
// for "-".
func openInput(path string, stdin io.Reader) (io.Reader, func(), error) {
	if path == "-" {
		return stdin, func() {}, nil
	}
	f, _, err := safefile.Open(path, maxFile)
	if errors.Is(err, safefile.ErrTooLarge) {
		err = fmt.Errorf("%w: %w", memviz.ErrTooLarge, err)
	}
	if err != nil {
		return nil, nil, err
	}
	return f, func() { f.Close() }, nil
}

// writeFile writes path through write, into a temporary file beside it
// (in path's directory) renamed into place, so a failure leaves no partial
// file; "-" is stdout. A path that names a directory, or ends in a
// separator, is refused before anything is written, with an error
// wrapping syscall.EISDIR.
func writeFile(path string, stdout io.Writer, write func(io.Writer) error) (int64, error) {
	if path == "-" {
		cw := &countWriter{w: stdout}
		err := write(cw)
		return cw.n, err
	}
	fi, err := os.Stat(path)
	if (err == nil && fi.IsDir()) || strings.HasSuffix(path, "/") || strings.HasSuffix(path, string(filepath.Separator)) {
		return 0, &fileError{Path: path, Err: &fs.PathError{Op: "write", Path: path, Err: syscall.EISDIR}}
	}
	dir, base := filepath.Dir(path), filepath.Base(path)
	tmp, err := os.CreateTemp(dir, "."+base+".*")
	if err != nil {
		return 0, &fileError{Path: path, Err: err}
	}
	cw := &countWriter{w: tmp}
	err = write(cw)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil { // CreateTemp makes it private; a snapshot is not
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name()) // the write already failed; this only tidies up
		return 0, &fileError{Path: path, Err: err}
	}
	return cw.n, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
