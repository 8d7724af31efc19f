package control

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

// Ack is the acknowledgement of one attempt to execute a command, whatever
// its outcome. It is a D-Bus struct too (strings only), so the bus, the
// file, the journal and the upload carry one schema.
type Ack struct {
	Schema uint32 `json:"schema"`
	Time   string `json:"time"` // RFC 3339, UTC
	Host   string `json:"host"` // this host's id
	// SHA256 is the hash of the canonical command bytes, or of the bytes
	// received when they did not parse as a command.
	SHA256 string `json:"sha256"`
	Status string `json:"status"` // executed, failed, rejected, duplicate, expired
	Reason string `json:"reason"`
	Action string `json:"action,omitempty"`
	Agent  string `json:"agent,omitempty"`
	Ban    string `json:"ban,omitempty"`
	Nonce  string `json:"nonce,omitempty"`
	// Source is "file" (cagectl control apply) or "channel".
	Source string `json:"source"`
	// By is who handed the command in: the bus caller, or for a channel
	// the feed entry ("controls/NAME").
	By string `json:"by,omitempty"`
}

// NewAck builds the ack of raw as far as it was understood.
func NewAck(host string, raw []byte, p *Parsed, status, reason, source, by string, now time.Time) Ack {
	a := Ack{Schema: Schema, Time: now.UTC().Format(time.RFC3339Nano), Host: host, Status: status, Reason: reason, Source: source, By: by}
	if p != nil {
		a.SHA256, a.Action, a.Agent, a.Ban, a.Nonce = p.Hash, p.Command.Action, p.Command.Agent, p.Command.Ban, p.Command.Nonce
	} else {
		a.SHA256 = HashBytes(raw)
	}
	return a
}

// AckLog is the host's acknowledgement file: JSON lines, appended and
// synced one record at a time. At MaxAckLog bytes the file is moved to
// NAME.1 (replacing the previous one) and a new one begun, so two files
// bound it; the journal keeps the full history.
type AckLog struct {
	path string
	mu   sync.Mutex
}

// MaxAckLog is the size at which the ack file is rotated.
const MaxAckLog = 1 << 20

// OpenAckLog uses the ack file at path; its directory is created (0700).
func OpenAckLog(path string) (*AckLog, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("acks: %w", err)
	}
	return &AckLog{path: path}, nil
}

// Append writes one ack.
func (l *AckLog) Append(a Ack) error {
	b, err := json.Marshal(a)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if st, err := os.Stat(l.path); err == nil && st.Size()+int64(len(b)) >= MaxAckLog {
		if err := os.Rename(l.path, l.path+".1"); err != nil {
			return fmt.Errorf("acks: rotate: %w", err)
		}
	}
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("acks: %w", err)
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("acks: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("acks: %w", err)
	}
	return f.Close()
}

// Read returns up to max acks, oldest first (the newest max when there are
// more). Lines that do not parse are skipped.
func (l *AckLog) Read(max int) ([]Ack, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Ack
	for _, p := range []string{l.path + ".1", l.path} {
		b, err := os.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("acks: %w", err)
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(make([]byte, 0, 64<<10), MaxSize*2)
		for sc.Scan() {
			var a Ack
			if json.Unmarshal(sc.Bytes(), &a) == nil {
				out = append(out, a)
			}
		}
	}
	if max > 0 && len(out) > max {
		out = out[len(out)-max:]
	}
	return out, nil
}

// UploadPath is where an ack goes under the upload URL:
// HOST/SHA256/STATUS.json. A controller lists HOST/SHA256/ to see what a
// host did with a command; a later duplicate overwrites duplicate.json,
// never executed.json.
func UploadPath(a Ack) string {
	return url.PathEscape(a.Host) + "/" + a.SHA256 + "/" + a.Status + ".json"
}

// UploadClient is the client acks are uploaded with: the release
// fetcher's guarded client (release.FetchClient), for the same reason. caged
// uploads as root from the host's network namespace, and the ack server (or,
// with an http ack_url, anyone on the path) answers; its redirects must not
// aim the PUT at this host's loopback, the LAN or a metadata service. The
// configured ack server itself may be anywhere the operator named.
func UploadClient(base string) (*http.Client, error) {
	u, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("upload ack: ack_url: %w", err)
	}
	return release.FetchClient(u), nil
}

// Upload PUTs the ack as JSON to base/UploadPath(a). Any 2xx is success.
func Upload(ctx context.Context, client *http.Client, base string, a Ack) error {
	b, err := json.Marshal(a)
	if err != nil {
		return err
	}
	u := strings.TrimSuffix(base, "/") + "/" + UploadPath(a)
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, u, bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("upload ack: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("upload ack: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("upload ack: PUT %s: %s", u, resp.Status)
	}
	return nil
}
