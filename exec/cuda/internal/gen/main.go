package main

import (
	"log"
	"os"

	"github.com/batchfit/batchfit/exec/cuda"
)

func main() {
	if err := os.WriteFile("kernels/opcodes.cuh", cuda.OpcodeHeader(), 0o644); err != nil {
		log.Fatal(err)
	}
}
