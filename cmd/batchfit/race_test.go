//go:build race

package main

// raceEnabled: the race detector multiplies a process's memory and time
// (5–10× and 2–20×), so tests of resource bounds skip under it.
const raceEnabled = true
