package batchfit

import "github.com/batchfit/batchfit/exec/cuda"

// CachedPrograms is how many compiled programs s keeps.
func CachedPrograms(s *Session) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.programs.Len()
}

// CachedPlans is how many plans s keeps.
func CachedPlans(s *Session) int { return s.plans.Len() }

// CUDAGraphStats is the CUDA graph counts of s's executor; false when s
// does not run on CUDA.
func CUDAGraphStats(s *Session) (cuda.GraphStats, bool) {
	if c, ok := s.be.(cudaOwner); ok {
		return c.GraphStats(), true
	}
	return cuda.GraphStats{}, false
}
