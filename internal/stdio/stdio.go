// Package stdio is the one definition of a program's terminal that every
// nixcage main hands to its Run function, so tests drive programs in-process
// with buffers instead of the process's own streams.
package stdio

import (
	"io"
	"os"
)

// Stdio is a program's view of the terminal.
type Stdio struct {
	In       io.Reader
	Out, Err io.Writer
}

// OS returns the process's own stdio.
func OS() Stdio { return Stdio{In: os.Stdin, Out: os.Stdout, Err: os.Stderr} }
