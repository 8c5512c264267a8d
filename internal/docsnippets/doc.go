// Package docsnippets holds the test that keeps the documentation's Go
// code compiling: every ```go block of README.md and docs/*.md is
// type-checked against the module, offline, from the export data of
// `go list -export`.
//
// A block that starts with `package` is a whole file. Any other is a
// fragment: it gets the imports it may use, and goes into a function body,
// or at file level when it declares a function (func in column 0). The variables a fragment takes from its surroundings are
// declared in an HTML comment on the line right above the block:
//
//	<!-- given: var sess *batchfit.Session; var images *tensor.Dense -->
//
// Lines that are only an ellipsis (… or ...), perhaps with a comment, stand
// for code left out and are dropped. Unused variables and imports are
// allowed (a fragment shows part of a program). The README's whole-file
// program must equal examples/quickstart/main.go byte for byte; that
// example's own test runs it.
package docsnippets
