package policy

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"
)

// The approval queue: a request the policy refuses only for not being
// listed (default-deny or port) waits while caged asks an operator. The
// gateway (a sandboxed dynamic user with no bus) and caged (root) talk
// through two directories, each written by one side only:
//
//   - the gateway writes one pending file per waiting request into
//     Approval.PendingDir, its own RuntimeDirectory (caged reads it as
//     untrusted input: every field is bounded and checked here);
//   - caged writes the operator's decision into Approval.DecisionsDir, in
//     the agent's root-owned runtime directory, which the gateway trusts
//     only as the grants file (root-owned, writable by nobody else).
//
// Neither the cage (no path to either directory) nor the gateway's own
// user (it cannot write DecisionsDir) can approve a request.

// Approval queue bounds: one default per knob, set here.
const (
	// DefaultApprovalWait is how long a request outside the policy waits
	// for an operator without approval.wait; MaxApprovalWait the longest
	// the config accepts (the agent's connection is held open meanwhile).
	DefaultApprovalWait = 30 * time.Second
	MaxApprovalWait     = 5 * time.Minute
	// DefaultMaxPending distinct requests wait at once per agent; more
	// are refused at once (rule approval-queue-full). MaxMaxPending is
	// the largest max_pending the config accepts.
	DefaultMaxPending = 4
	MaxMaxPending     = 32
	// DeniedCooldown: after a deny, the same host and port are refused at
	// once for this long without asking again (a retrying harness must not
	// page the operator every second).
	DeniedCooldown = time.Minute
	// MaxPendingPath bounds the path a pending request shows.
	MaxPendingPath = 256
	// MaxApprovalFile bounds what either side reads of the other's file.
	MaxApprovalFile = 4096
)

// Verdicts an operator gives (`cagectl approve ID once|host|deny`).
const (
	VerdictOnce = "once" // this request (and any waiting for the same host and port)
	VerdictHost = "host" // a time-bound grant for the host (DefaultGrantDuration), then this request
	VerdictDeny = "deny"
)

// Audit rules of approval decisions.
const (
	RuleApproval          = "approval" // approval:ID, allowed
	RuleApprovalDenied    = "approval-denied"
	RuleApprovalTimeout   = "approval-timeout"
	RuleApprovalQueueFull = "approval-queue-full"
)

// Approval is the approval part of the runtime document (nil: off).
type Approval struct {
	WaitSeconds  int64  `json:"wait_seconds"`
	MaxPending   int    `json:"max_pending"`
	PendingDir   string `json:"pending_dir"`
	DecisionsDir string `json:"decisions_dir"`
}

// Wait is how long a request waits.
func (a *Approval) Wait() time.Duration { return time.Duration(a.WaitSeconds) * time.Second }

// Check reports an approval block the gateway cannot enforce.
func (a *Approval) Check() error {
	if a.WaitSeconds < 1 || a.Wait() > MaxApprovalWait {
		return fmt.Errorf("approval.wait_seconds %d: want 1 to %d", a.WaitSeconds, int64(MaxApprovalWait/time.Second))
	}
	if a.MaxPending < 1 || a.MaxPending > MaxMaxPending {
		return fmt.Errorf("approval.max_pending %d: want 1 to %d", a.MaxPending, MaxMaxPending)
	}
	for _, d := range []string{a.PendingDir, a.DecisionsDir} {
		if !filepath.IsAbs(d) || filepath.Clean(d) != d {
			return fmt.Errorf("approval directory %q: want a clean absolute path", d)
		}
	}
	return nil
}

// ApprovalSchema versions both files.
const ApprovalSchema = 1

var approvalIDRE = regexp.MustCompile(`^a-[0-9a-f]{12}$`)

// NewApprovalID is a fresh id ("a-" and 12 hex digits from crypto/rand).
func NewApprovalID() (string, error) {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "a-" + hex.EncodeToString(b[:]), nil
}

// CheckApprovalID reports an id that is not one NewApprovalID makes (ids
// become file names).
func CheckApprovalID(id string) error {
	if !approvalIDRE.MatchString(id) {
		return fmt.Errorf("approval id %q: want a- and 12 hex digits", id)
	}
	return nil
}

// Pending is a request waiting for an operator, as the gateway writes it.
type Pending struct {
	Schema      int    `json:"schema"`
	ID          string `json:"id"`
	Agent       string `json:"agent"`
	Method      string `json:"method"`
	Host        string `json:"host"`
	Port        int    `json:"port"`
	Path        string `json:"path,omitempty"`
	SinceUnix   int64  `json:"since_unix"`
	ExpiresUnix int64  `json:"expires_unix"`
}

func (p *Pending) header() (int, string) { return p.Schema, p.Agent }

// CutPath bounds a request path for a pending file, on a rune boundary.
func CutPath(p string) string {
	if len(p) <= MaxPendingPath {
		return p
	}
	p = p[:MaxPendingPath]
	for !utf8.ValidString(p) {
		p = p[:len(p)-1]
	}
	return p
}

// ParsePending decodes a pending file strictly and checks every field: it
// comes from the gateway, whose fields come from the agent.
func ParsePending(data []byte, agent string) (*Pending, error) {
	if len(data) > MaxApprovalFile {
		return nil, fmt.Errorf("pending approval: %d bytes, more than %d", len(data), MaxApprovalFile)
	}
	var p Pending
	if err := decodeDoc(data, "pending approval", &p, ApprovalSchema, agent); err != nil {
		return nil, err
	}
	if err := CheckApprovalID(p.ID); err != nil {
		return nil, err
	}
	if err := CheckPattern(p.Host); err != nil || strings.HasPrefix(p.Host, "*") {
		return nil, fmt.Errorf("pending approval %s: host %q is not a host name", p.ID, p.Host)
	}
	if p.Port < 1 || p.Port > 65535 {
		return nil, fmt.Errorf("pending approval %s: port %d", p.ID, p.Port)
	}
	if p.Method == "" || len(p.Method) > 16 || strings.IndexFunc(p.Method, func(r rune) bool { return r < 'A' || r > 'Z' }) >= 0 {
		return nil, fmt.Errorf("pending approval %s: method %q", p.ID, p.Method)
	}
	if len(p.Path) > MaxPendingPath || !utf8.ValidString(p.Path) {
		return nil, fmt.Errorf("pending approval %s: path longer than %d bytes or not UTF-8", p.ID, MaxPendingPath)
	}
	if p.ExpiresUnix < p.SinceUnix || time.Duration(p.ExpiresUnix-p.SinceUnix)*time.Second > MaxApprovalWait+time.Second {
		return nil, fmt.Errorf("pending approval %s: waits %ds, more than %s", p.ID, p.ExpiresUnix-p.SinceUnix, MaxApprovalWait)
	}
	return &p, nil
}

// ApprovalDecision is an operator's verdict on a pending request.
type ApprovalDecision struct {
	Schema      int    `json:"schema"`
	ID          string `json:"id"`
	Agent       string `json:"agent"`
	Verdict     string `json:"verdict"`
	By          string `json:"by"`
	Grant       string `json:"grant,omitempty"` // with VerdictHost: the grant made
	DecidedUnix int64  `json:"decided_unix"`
}

func (d *ApprovalDecision) header() (int, string) { return d.Schema, d.Agent }

// DecisionFile is where the decision on id goes.
func (a *Approval) DecisionFile(id string) string { return filepath.Join(a.DecisionsDir, id+".json") }

// PendingFile is where the pending request id goes.
func (a *Approval) PendingFile(id string) string { return filepath.Join(a.PendingDir, id+".json") }

// LoadDecision reads the decision on id if caged has written one: nil and
// no error when there is none yet. It is trusted only as the grants file
// is (root-owned, writable by nobody else, in such a directory).
func LoadDecision(a *Approval, agent, id string) (*ApprovalDecision, error) {
	data, err := readTrusted(a.DecisionFile(id))
	if err != nil {
		if os.IsNotExist(err) {
			return nil, nil
		}
		return nil, err
	}
	var d ApprovalDecision
	if err := decodeDoc(data, "approval decision", &d, ApprovalSchema, agent); err != nil {
		return nil, err
	}
	if d.ID != id {
		return nil, fmt.Errorf("approval decision names %q, not %q", d.ID, id)
	}
	switch d.Verdict {
	case VerdictOnce, VerdictHost, VerdictDeny:
	default:
		return nil, fmt.Errorf("approval decision %s: verdict %q", id, d.Verdict)
	}
	return &d, nil
}

// WriteFileAtomic replaces path with data (mode 0644) by a temporary file
// in the same directory, fsync and rename, so a reader never sees half a
// file. Both sides of the grants and approval files write through it.
func WriteFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Chmod(0o644)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// MarshalDoc renders one of the small files with a trailing newline.
func MarshalDoc(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
