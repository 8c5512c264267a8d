package cuda

// Do runs fn on the device goroutine, for tests of the re-entrant path.
func (d *Device) Do(fn func() error) error { return d.do(fn) }
