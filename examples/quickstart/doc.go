// Command quickstart is the README's program, word for word (a test in
// internal/docsnippets holds the two equal): an MLP trained for ten Adam
// steps on generated data within a 64 MiB budget, which the planner meets
// by running the batch in chunks with the whole batch's gradients.
//
//	go run ./examples/quickstart
package main
