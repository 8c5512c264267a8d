package precision

// SetAlignLinears turns the alignment of wide 16-bit linear layers
// (alignedLinear) on or off, for tests that compare the two graphs; it
// returns the previous setting.
func SetAlignLinears(on bool) bool {
	prev := alignLinears
	alignLinears = on
	return prev
}

// SetFusePaddedLoss turns the fusion of a padded linear's slice into the
// cross_entropy it feeds (fusedLoss) on or off, for tests that compare the
// two graphs; it returns the previous setting.
func SetFusePaddedLoss(on bool) bool {
	prev := fusePaddedLoss
	fusePaddedLoss = on
	return prev
}

// AlignOutputs is the multiple a wide linear's outputs are padded to.
const AlignOutputs = alignOutputs

// SetFoldCasts turns the folding of widening casts into the matmuls they
// read (foldWideningCasts) on or off, for tests that compare the two
// graphs; it returns the previous setting.
func SetFoldCasts(on bool) bool {
	prev := foldCasts
	foldCasts = on
	return prev
}

// SetFoldNorms turns the 16-bit layer norms that GEMMs read (halfNorm) on
// or off, for tests that compare the two graphs; it returns the previous
// setting.
func SetFoldNorms(on bool) bool {
	prev := foldNorms
	foldNorms = on
	return prev
}

// SetFuseGelu turns the gelu_grad fusion of mixed-precision training
// graphs on or off; it returns the previous setting.
func SetFuseGelu(on bool) bool {
	prev := fuseGelu
	fuseGelu = on
	return prev
}

// SetFuseLayerNormGrad turns the layer_norm_grad_x + add fusion of
// training graphs on or off; it returns the previous setting.
func SetFuseLayerNormGrad(on bool) bool {
	prev := fuseLayerNormGrad
	fuseLayerNormGrad = on
	return prev
}
