// Package auditlog reads the egress gateway's JSONL audit log: whole records
// from a byte offset, or the newest ones, never a record the gateway is still
// writing. caged serves it over the bus; cagectl reads it directly as root.
package auditlog

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
)

// MaxRead bounds one read, in bytes.
const MaxRead = 4 << 20

// Read returns complete records of the log at path from offset on (at most
// max) and the offset to continue from. A negative offset means "the newest
// max records". A missing log is empty; an offset beyond the end (the log
// was truncated or rotated) starts again at 0; an offset inside a record
// starts at the next one, so every record returned is whole.
func Read(path string, offset int64, max int) ([]string, int64, error) {
	f, err := Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, 0, fmt.Errorf("audit: %w", err)
	}
	size := st.Size()
	tail := offset < 0
	if tail {
		offset = max64(0, size-MaxRead)
	}
	if offset > size {
		offset = 0
	}
	// An offset is a record start only right after a newline; anything
	// else (a caller's guess, a stale offset) starts at the next record.
	midRecord := false
	if !tail && offset > 0 {
		var prev [1]byte
		if _, err := f.ReadAt(prev[:], offset-1); err != nil {
			return nil, 0, fmt.Errorf("audit: %w", err)
		}
		midRecord = prev[0] != '\n'
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil, 0, fmt.Errorf("audit: %w", err)
	}
	br := bufio.NewReaderSize(io.LimitReader(f, MaxRead), 64<<10)
	var lines []string
	pos := offset
	skipFirst := tail && offset > 0 || midRecord // started in the middle of a record
	for {
		b, err := br.ReadBytes('\n')
		if err != nil {
			break // a partial last record waits for the next read
		}
		pos += int64(len(b))
		if skipFirst {
			skipFirst = false
			continue
		}
		if line := string(bytes.TrimRight(b, "\n")); line != "" {
			lines = append(lines, line)
		}
		if !tail && len(lines) >= max {
			break
		}
	}
	if tail && len(lines) > max {
		lines = lines[len(lines)-max:]
	}
	return lines, pos, nil
}

func max64(a, b int64) int64 {
	if a > b {
		return a
	}
	return b
}
