package precision

// swap sets *flag to on and returns what it was.
func swap(flag *bool, on bool) bool {
	prev := *flag
	*flag = on
	return prev
}

// SetAlignLinears turns the alignment of wide 16-bit linear layers
// (alignedLinear) on or off, for tests that compare the two graphs; it
// returns the previous setting.
func SetAlignLinears(on bool) bool { return swap(&alignLinears, on) }

// SetFusePaddedLoss turns the fusion of a padded linear's slice into the
// cross_entropy it feeds (fusedLoss) on or off, for tests that compare the
// two graphs; it returns the previous setting.
func SetFusePaddedLoss(on bool) bool { return swap(&fusePaddedLoss, on) }

// AlignOutputs is the multiple a wide linear's outputs are padded to.
const AlignOutputs = alignOutputs

// SetFoldCasts turns the folding of widening casts into the matmuls they
// read (foldWideningCasts) on or off, for tests that compare the two
// graphs; it returns the previous setting.
func SetFoldCasts(on bool) bool { return swap(&foldCasts, on) }

// SetFoldNorms turns the 16-bit layer norms that GEMMs read (halfNorm) on
// or off, for tests that compare the two graphs; it returns the previous
// setting.
func SetFoldNorms(on bool) bool { return swap(&foldNorms, on) }

// SetFoldRMSNorms turns the 16-bit RMS norms that GEMMs read (halfNorm)
// on or off; it returns the previous setting.
func SetFoldRMSNorms(on bool) bool { return swap(&foldRMSNorms, on) }

// SetFuseGelu turns the gelu_grad fusion of mixed-precision training
// graphs on or off; it returns the previous setting.
func SetFuseGelu(on bool) bool { return swap(&fuseGelu, on) }

// SetFuseLayerNormGrad turns the layer_norm_grad_x + add fusion of
// training graphs on or off; it returns the previous setting.
func SetFuseLayerNormGrad(on bool) bool { return swap(&fuseLayerNormGrad, on) }

// SetFusePointwise turns graph.FusePointwise in training graphs on or
// off; it returns the previous setting.
func SetFusePointwise(on bool) bool { return swap(&fusePointwise, on) }
