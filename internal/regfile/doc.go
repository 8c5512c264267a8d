// Package regfile opens files from outside the program (snapshots,
// profiles, configs) as hostile input: regular files only, checked on the
// open descriptor, with the size limit decided from fstat before a byte is
// read. A FIFO, a device (a symlink to /dev/zero), a socket or a directory
// is refused at once: the open is non-blocking, so a FIFO with no writer
// cannot hang it.
package regfile
