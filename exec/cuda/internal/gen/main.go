package main

import (
	"log"
	"os"

	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
)

func main() {
	if err := os.WriteFile("kernels/opcodes.cuh", opcode.Header(), 0o644); err != nil {
		log.Fatal(err)
	}
}
