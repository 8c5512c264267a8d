package docsnippets

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// imports are the packages a fragment may use, by the name it uses.
var imports = map[string]string{
	"context": "context", "errors": "errors", "fmt": "fmt", "io": "io", "log": "log", "math": "math",
	"os": "os", "time": "time", "rand": "math/rand/v2", "strings": "strings",
	"tensor":     "gorgonia.org/tensor",
	"batchfit":   "github.com/batchfit/batchfit",
	"alloc":      "github.com/batchfit/batchfit/alloc",
	"checkpoint": "github.com/batchfit/batchfit/checkpoint",
	"data":       "github.com/batchfit/batchfit/data",
	"dist":       "github.com/batchfit/batchfit/dist",
	"exec":       "github.com/batchfit/batchfit/exec",
	"graph":      "github.com/batchfit/batchfit/graph",
	"hf":         "github.com/batchfit/batchfit/hf",
	"lazy":       "github.com/batchfit/batchfit/lazy",
	"memviz":     "github.com/batchfit/batchfit/memviz",
	"models":     "github.com/batchfit/batchfit/models",
	"nn":         "github.com/batchfit/batchfit/nn",
	"optim":      "github.com/batchfit/batchfit/optim",
	"planner":    "github.com/batchfit/batchfit/planner",
	"precision":  "github.com/batchfit/batchfit/precision",
	"recompute":  "github.com/batchfit/batchfit/recompute",
	"shapeinfer": "github.com/batchfit/batchfit/shapeinfer",
	"train":      "github.com/batchfit/batchfit/train",
}

// snippet is one ```go block: where it starts (the line after the fence),
// its lines, and the declarations given above it.
type snippet struct {
	file  string
	line  int
	code  []string
	given string
}

var givenRe = regexp.MustCompile(`^<!--\s*given:(.*)-->\s*$`)

// extract returns the ```go blocks of a Markdown file.
func extract(t *testing.T, path, name string) []snippet {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []snippet
	var cur *snippet
	prev := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go":
			cur = &snippet{file: name, line: n + 1}
			if m := givenRe.FindStringSubmatch(strings.TrimSpace(prev)); m != nil {
				cur.given = strings.TrimSpace(m[1])
			}
		case cur != nil && strings.TrimSpace(line) == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.code = append(cur.code, line)
		}
		prev = line
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur != nil {
		t.Fatalf("%s:%d: a ```go block is not closed", name, cur.line-1)
	}
	return out
}

var (
	ellipsis  = regexp.MustCompile(`^\s*(…|\.\.\.)\s*(//.*)?$`)
	fileLevel = regexp.MustCompile(`^func [A-Za-z_(]`)
)

// source completes s into a Go file, its lines mapped back to the
// Markdown file by //line directives.
func source(s snippet) string {
	var b strings.Builder
	code := make([]string, len(s.code))
	whole, decls := false, false
	for i, l := range s.code {
		if ellipsis.MatchString(l) {
			l = ""
		}
		code[i] = l
		if i == 0 && strings.HasPrefix(l, "package ") {
			whole = true
		}
		if fileLevel.MatchString(l) {
			decls = true
		}
	}
	body := strings.Join(code, "\n")
	if whole {
		fmt.Fprintf(&b, "//line %s:%d\n%s\n", s.file, s.line, body)
		return b.String()
	}
	b.WriteString("package snippet\n\nimport (\n")
	names := make([]string, 0, len(imports))
	for name := range imports {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Fprintf(&b, "\t%s %q\n", name, imports[name])
	}
	b.WriteString(")\n\n")
	if s.given != "" {
		fmt.Fprintf(&b, "//line %s:%d\n%s\n", s.file, s.line-2, s.given)
	}
	if decls {
		fmt.Fprintf(&b, "//line %s:%d\n%s\n", s.file, s.line, body)
	} else {
		fmt.Fprintf(&b, "func _() {\n//line %s:%d\n%s\n}\n", s.file, s.line, body)
	}
	return b.String()
}

// exports maps import paths to their export data, from go list -export
// run in the module (offline: the module cache and build cache only).
func exports(t *testing.T, root string, paths []string) map[string]string {
	t.Helper()
	gobin, err := exec.LookPath("go") // go test puts its own go first on PATH
	if err != nil {
		t.Fatalf("no go command: %v", err)
	}
	cmd := exec.Command(gobin, append([]string{"list", "-export", "-deps", "-f", "{{.ImportPath}}\t{{.Export}}"}, paths...)...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=readonly", "GOPROXY=off", "GOTOOLCHAIN=local", "CGO_ENABLED=0")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -export: %v\n%s", err, stderr.String())
	}
	m := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if path, file, ok := strings.Cut(line, "\t"); ok && file != "" {
			m[path] = file
		}
	}
	return m
}

// check type-checks one file and returns its hard errors (unused
// variables and imports, soft errors, are allowed).
func check(fset *token.FileSet, imp types.Importer, name, src string) []error {
	f, err := parser.ParseFile(fset, name, src, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil {
		return []error{err}
	}
	var errs []error
	conf := types.Config{Importer: imp, Error: func(err error) {
		var te types.Error
		if errors.As(err, &te) && te.Soft {
			return
		}
		errs = append(errs, err)
	}}
	_, _ = conf.Check("snippet", fset, []*ast.File{f}, nil)
	return errs
}

func TestDocSnippetsCompile(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	var all []snippet
	for _, path := range append([]string{filepath.Join(root, "README.md")}, docs...) {
		rel, _ := filepath.Rel(root, path)
		all = append(all, extract(t, path, rel)...)
	}
	if len(all) < 5 {
		t.Fatalf("found %d Go snippets in README.md and docs/*.md; the guides hold more", len(all))
	}

	paths := make([]string, 0, len(imports))
	for _, p := range imports {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	exp := exports(t, root, paths)
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := exp[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %q (add it to the snippet imports)", path)
		}
		return os.Open(file)
	})
	for i, s := range all {
		for _, err := range check(fset, imp, fmt.Sprintf("snippet%d.go", i), source(s)) {
			t.Errorf("%v", err)
		}
	}
}

// The README's program is examples/quickstart/main.go, which that
// package's test runs.
func TestReadmeProgramIsQuickstart(t *testing.T) {
	var whole []snippet
	for _, s := range extract(t, "../../README.md", "README.md") {
		if len(s.code) > 0 && strings.HasPrefix(s.code[0], "package ") {
			whole = append(whole, s)
		}
	}
	if len(whole) != 1 {
		t.Fatalf("README.md has %d complete programs, want 1", len(whole))
	}
	want, err := os.ReadFile("../../examples/quickstart/main.go")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(whole[0].code, "\n") + "\n"; got != string(want) {
		t.Errorf("README.md:%d: the program differs from examples/quickstart/main.go; copy it over", whole[0].line)
	}
	if n := len(whole[0].code); n > 40 {
		t.Errorf("README.md:%d: the program is %d lines, at most 40", whole[0].line, n)
	}
}

// The README is the front door: a newcomer's two minutes.
func TestReadmeIsShort(t *testing.T) {
	data, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(data, []byte("\n")); n > 200 {
		t.Errorf("README.md is %d lines; move detail into docs/ (at most 200)", n)
	}
}

// The repository speaks of the software: no numbered sessions, issues,
// calls or turns of the work that made it, in Markdown, Go, Python or
// shell files.
func TestNoProcessTalk(t *testing.T) {
	talk := regexp.MustCompile(`(?i)\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|previous|earlier|last|next) (developer )?session\b|\bissues? #?[0-9]+\b|\bcall [0-9]+\b|\bturn [0-9]+\b`)
	root := "../.."
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") && name != ".ci" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(path) {
		case ".md", ".go", ".py", ".sh":
		default:
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, line := range strings.Split(string(data), "\n") {
			if talk.MatchString(line) {
				rel, _ := filepath.Rel(root, path)
				t.Errorf("%s:%d speaks of how the work was done, not of the software: %s", rel, i+1, strings.TrimSpace(line))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
