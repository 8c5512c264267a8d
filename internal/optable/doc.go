// Package optable builds the kernel tables of the executors (exec/cpu,
// exec/cuda) and of the reference interpreter (internal/ref): each family
// file declares its ops' entries as a map, and Build lays the families out
// in one array indexed by graph.Op. Problems is what their completeness
// tests check: every op but the sources has exactly one entry.
package optable
