// Package safefile is the one home for opening files that come from
// outside the program (checkpoints, configs, tokenizers, snapshots,
// profiles) as hostile input: regular files only, checked with fstat on
// the open descriptor (symbolic links are followed; what they reach must
// be regular), with the size limit decided from that fstat before a byte
// is read. A FIFO, a device (a symlink to /dev/zero), a socket or a
// directory is refused at once: the open is non-blocking, so a FIFO with
// no writer cannot hang it.
package safefile
