package quarantine

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/auditlog"
)

// Files in an evidence directory.
const (
	ManifestName = "SHA256SUMS"
	WorkspaceDir = "workspace"
	AuditName    = "audit.jsonl"
	StatusName   = "status.json"
	MarkName     = "quarantine.json"
	SymlinksName = "symlinks.txt"
	OmittedName  = "omitted.txt"
	NamesName    = "names.txt"
	SummaryName  = "evidence.json"
	// DefaultMaxAudit caps the audit excerpt (what it keeps first:
	// auditlog.Excerpt).
	DefaultMaxAudit = 64 << 20
)

// Collection is what to preserve.
type Collection struct {
	Agent     string
	Workspace string // host path as declared; mapped under Dirs.Root
	Mark      *Mark
	Status    any
	Now       time.Time
	MaxAudit  int64
	Limits    Limits
}

// Evidence describes a collected evidence directory.
type Evidence struct {
	Dir   string
	Files int
	Bytes int64
	// Omitted counts entries of omitted.txt: workspace entries left out or
	// cut short, and a stopped walk.
	Omitted int
	// Stopped says which limit ended the workspace walk early, if any.
	Stopped string
}

// summary is evidence.json: what the copy was allowed and what it did.
type summary struct {
	Limits struct {
		MaxBytes      int64  `json:"max_bytes"`
		MaxEntries    int    `json:"max_entries"`
		MaxDuration   string `json:"max_duration"`
		MaxPathLength int    `json:"max_path_length"`
	} `json:"limits"`
	WorkspaceBytes   int64  `json:"workspace_bytes"`
	WorkspaceEntries int    `json:"workspace_entries"`
	Omitted          int    `json:"omitted"`
	Stopped          string `json:"stopped,omitempty"`
	Complete         bool   `json:"complete"`
}

type manifest struct {
	lines []string
	files int
	bytes int64
}

// add records one file; names with '\\' or newlines are escaped the way
// GNU sha256sum does, so `sha256sum -c` reads every line.
func (m *manifest) add(rel string, sum []byte, n int64) {
	name, prefix := rel, ""
	if strings.ContainsAny(rel, "\\\n") {
		name = strings.NewReplacer(`\`, `\\`, "\n", `\n`).Replace(rel)
		prefix = `\`
	}
	m.lines = append(m.lines, prefix+hex.EncodeToString(sum)+"  "+name)
	m.files++
	m.bytes += n
}

// Collect writes an evidence directory for c.Agent under d.EvidenceRoot().
// The directory is assembled under a ".partial" name and renamed when
// complete, so a directory without that suffix is always whole.
func Collect(d Dirs, c Collection) (*Evidence, error) {
	root := d.EvidenceRoot()
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("evidence: %w", err)
	}
	base := filepath.Join(root, c.Agent+"-"+c.Now.UTC().Format("20060102T150405Z"))
	final := base
	for i := 1; ; i++ {
		if _, err := os.Lstat(final); errors.Is(err, os.ErrNotExist) {
			break
		}
		final = fmt.Sprintf("%s-%d", base, i)
	}
	tmp := final + ".partial"
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("evidence: %w", err)
	}
	m := &manifest{}
	w, err := collect(d, c, tmp, m)
	if err != nil {
		return nil, fmt.Errorf("evidence for %s (partial copy in %s): %w", c.Agent, tmp, err)
	}
	sort.Strings(m.lines)
	body := strings.Join(m.lines, "\n")
	if body != "" {
		body += "\n"
	}
	if err := os.WriteFile(filepath.Join(tmp, ManifestName), []byte(body), 0o600); err != nil {
		return nil, fmt.Errorf("evidence manifest: %w", err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return nil, fmt.Errorf("evidence: %w", err)
	}
	return &Evidence{Dir: final, Files: m.files, Bytes: m.bytes, Omitted: w.nOmit, Stopped: w.stopped}, nil
}

func collect(d Dirs, c Collection, dir string, m *manifest) (*walker, error) {
	lim := c.Limits.withDefaults()
	w := &walker{lim: lim, deadline: time.Now().Add(lim.MaxDuration), m: m}
	if err := writeJSON(dir, MarkName, c.Mark, m); err != nil {
		return nil, err
	}
	if err := writeJSON(dir, StatusName, c.Status, m); err != nil {
		return nil, err
	}
	max := c.MaxAudit
	if max <= 0 {
		max = DefaultMaxAudit
	}
	if err := copyAudit(d.AuditFile(c.Agent), filepath.Join(dir, AuditName), c.Agent, max, m); err != nil {
		w.omit(AuditName, err.Error())
	}
	if c.Workspace != "" {
		if err := copyWorkspace(d.Host(c.Workspace), dir, w); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct {
		name string
		body *strings.Builder
	}{{SymlinksName, &w.links}, {OmittedName, &w.omitted}, {NamesName, &w.names}} {
		if err := writeFile(dir, f.name, []byte(f.body.String()), m); err != nil {
			return nil, err
		}
	}
	var sum summary
	sum.Limits.MaxBytes, sum.Limits.MaxEntries = lim.MaxBytes, lim.MaxEntries
	sum.Limits.MaxDuration, sum.Limits.MaxPathLength = lim.MaxDuration.String(), MaxPathLen
	sum.WorkspaceBytes, sum.WorkspaceEntries = w.bytes, w.entries
	sum.Omitted, sum.Stopped, sum.Complete = w.nOmit, w.stopped, w.nOmit == 0
	if err := writeJSON(dir, SummaryName, sum, m); err != nil {
		return nil, err
	}
	return w, nil
}

func writeJSON(dir, name string, v any, m *manifest) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return writeFile(dir, name, append(b, '\n'), m)
}

func writeFile(dir, name string, b []byte, m *manifest) error {
	if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
		return err
	}
	sum := sha256.Sum256(b)
	m.add(name, sum[:], int64(len(b)))
	return nil
}

// copyAudit writes the audit excerpt (auditlog.Excerpt: summaries and the
// first record of each distinct decision, rule and host, then the newest
// non-DNS and DNS records that fit in max bytes, and a summary counting
// what was left out), opened without following links. A missing
// log (the gateway never ran) is an empty excerpt.
func copyAudit(src, dst, agent string, max int64, m *manifest) error {
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(auditlog.Excerpt(pw, src, agent, max)) }()
	err := copyStream(pr, dst, 0o600, filepath.Base(dst), m)
	pr.CloseWithError(io.ErrClosedPipe) // lets Excerpt end if copyStream failed first
	if err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	return nil
}

func copyStream(r io.Reader, dst string, mode fs.FileMode, rel string, m *manifest) error {
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(out, h), r)
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("copy %s: %w", rel, err)
	}
	m.add(rel, h.Sum(nil), n)
	return nil
}

// copyWorkspace copies the agent's workspace relative to open directory
// descriptors (see walker), so no symlink the agent planted can make caged
// (root) read outside it and no entry can end the copy. Symlinks are
// recreated, not followed, and listed in symlinks.txt; what is left out
// (specials, unreadable entries, whatever a limit cut) is named in
// omitted.txt, and names that had to be encoded in names.txt.
func copyWorkspace(ws, dir string, w *walker) error {
	// DynamicUser state directories are symlinks into /var/lib/private; the
	// top-level link is systemd's, not the agent's.
	real, err := filepath.EvalSymlinks(ws)
	if err != nil {
		w.omit(WorkspaceDir, fmt.Sprintf("workspace %s not copied: %v", ws, err))
		return nil
	}
	if err := os.Mkdir(filepath.Join(dir, WorkspaceDir), 0o700); err != nil {
		return fmt.Errorf("evidence: %w", err)
	}
	dst, err := unix.Open(filepath.Join(dir, WorkspaceDir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("evidence: %w", err)
	}
	defer unix.Close(dst)
	src, err := unix.Open(real, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		w.omit(WorkspaceDir, fmt.Sprintf("workspace %s not copied: %v", ws, err))
		return nil
	}
	defer unix.Close(src)
	w.dir(src, dst, WorkspaceDir, WorkspaceDir)
	w.copyLarge(src, dst)
	return nil
}

// Verify re-hashes every file listed in dir's manifest (what `sha256sum -c`
// does) and reports the first mismatch. Names in its errors are quoted:
// they come from the agent.
func Verify(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, ManifestName))
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		if line == "" {
			continue
		}
		escaped := strings.HasPrefix(line, `\`)
		line = strings.TrimPrefix(line, `\`)
		sum, name, ok := strings.Cut(line, "  ")
		if !ok {
			return fmt.Errorf("verify: bad manifest line %q", line)
		}
		if escaped {
			name = strings.NewReplacer(`\\`, `\`, `\n`, "\n").Replace(name)
		}
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			var pe *fs.PathError
			if errors.As(err, &pe) {
				err = pe.Err
			}
			return fmt.Errorf("verify %q: %w", name, err)
		}
		h := sha256.New()
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return fmt.Errorf("verify %q: %w", name, err)
		}
		if hex.EncodeToString(h.Sum(nil)) != sum {
			return fmt.Errorf("verify: %q does not match the manifest", name)
		}
	}
	return nil
}
