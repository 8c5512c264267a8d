package batchfit

// CachedPrograms is how many compiled programs s keeps.
func CachedPrograms(s *Session) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.programs.Len()
}

// CachedPlans is how many plans s keeps.
func CachedPlans(s *Session) int { return s.plans.Len() }
