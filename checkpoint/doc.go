// Package checkpoint saves and restores a training run: the model's
// parameters and buffers, the optimizer's state, the schedule's position,
// dynamic loss scaling, the dropout layers' random streams and the data
// loader's position, so that a run resumed from a checkpoint continues
// bit for bit as the uninterrupted run would have (on the CPU; on CUDA as
// far as the kernels are deterministic, see below).
//
//	ck := &checkpoint.Training{Model: model, Optimizer: opt, Session: sess}
//	if err := ck.Load(dir); err == nil { // resume: ck.Step, ck.Data set
//		…
//	} else if !errors.Is(err, checkpoint.ErrNoCheckpoint) {
//		return err
//	}
//	loader, err := data.NewLoader(ds, data.Options{…, Start: ck.Data})
//	…every k steps: ck.Step, ck.Data = done, loader.Position(); ck.Save(dir)
//
// # The directory
//
// Save writes dir/ckpt-NNNNNNNN (the step) and points dir/latest at it.
// A checkpoint directory holds:
//
//	manifest.json          format and version, the step, what wrote it (program,
//	                       module, VCS revision, Go, time), every file's size and
//	                       every tensor's name, dtype, shape and SHA-256, the
//	                       optimizer's hyperparameters, groups and per-parameter
//	                       step counts, the loss scale, the dropout counters, the
//	                       data position, and its own SHA-256
//	model.safetensors      the parameters of a models.GPT or Llama-family model,
//	config.json            as hf.Save writes them: from_pretrained loads the
//	                       directory, and hf.LoadInto does
//	params.safetensors     any other model's parameters, under their nn names
//	optimizer.safetensors  each parameter's state slots, "<name>.exp_avg",
//	                       "<name>.exp_avg_sq" (Adam), "<name>.momentum_buffer" (SGD)
//	buffers.safetensors    the model's buffers (batch norms' running statistics)
//
// Every tensor is float32, as the training holds it, so nothing is
// rounded. A save is atomic: it is built in a hidden temporary directory
// beside the others, every file synced, the directory synced and renamed,
// and only then is the latest pointer replaced (a synced temporary file
// renamed over it). A crash at any point, mid-save included, leaves
// latest naming the last complete checkpoint; the next save clears the
// debris. Save keeps Training.Keep checkpoints (2 by default).
//
// # Loading
//
// Files are hostile: the manifest is read within MaxManifestBytes, as a
// regular file opened without blocking; its format version must be one
// this package reads (ErrVersion), its fields known and consistent
// (ErrCorrupt), its checksum its own. Every file must be regular, of its
// size (ErrTruncated when shorter), every tensor in it of the manifest's
// dtype and shape with the manifest's SHA-256 (ErrChecksum,
// ErrMissingTensor). Then the checkpoint must fit the training: a
// parameter of another shape is a *ShapeError naming it and both shapes;
// a parameter, buffer or dropout layer only one side has, another
// optimizer, or a checkpoint without the optimizer's state is
// ErrMismatch. Only then does anything change.
//
// # Devices
//
// On CUDA a Session keeps parameters and optimizer state on the device
// between steps. Save syncs them (Session.SyncParams, SyncState) when
// Training.Session is set. Load writes the host tensors and the
// optimizer's host state, and then calls Session.UploadParams, which
// copies every parameter's host tensor to the device copy it replaces;
// the optimizer's restored state is uploaded by the next step. Loading
// before a session's first Step needs neither: its first step uploads
// everything.
//
// Resumed CUDA runs are bit-identical where the kernels are
// deterministic: an embedding's backward pass sums rows hit by several
// tokens with atomic adds, in an order that varies from run to run, so a
// language model's runs (interrupted or not) agree only to rounding.
package checkpoint
