package quarantine

import (
	"bytes"
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
	// DefaultMaxAudit caps the audit excerpt: the newest records are kept.
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
}

// Evidence describes a collected evidence directory.
type Evidence struct {
	Dir   string
	Files int
	Bytes int64
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
	if err := collect(d, c, tmp, m); err != nil {
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
	return &Evidence{Dir: final, Files: m.files, Bytes: m.bytes}, nil
}

func collect(d Dirs, c Collection, dir string, m *manifest) error {
	if err := writeJSON(dir, MarkName, c.Mark, m); err != nil {
		return err
	}
	if err := writeJSON(dir, StatusName, c.Status, m); err != nil {
		return err
	}
	max := c.MaxAudit
	if max <= 0 {
		max = DefaultMaxAudit
	}
	if err := copyAudit(d.AuditFile(c.Agent), filepath.Join(dir, AuditName), c.Agent, max, m); err != nil {
		return err
	}
	if c.Workspace == "" {
		return nil
	}
	return copyWorkspace(d.Host(c.Workspace), dir, m)
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

// copyAudit writes the audit excerpt (auditlog.Excerpt: every non-DNS
// record, then the newest DNS records that fit in max bytes, and a summary
// counting what was left out), opened without following links. A missing
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

// copyWorkspace copies the agent's workspace through an os.Root, so no
// symlink the agent planted can make caged (root) read outside it. Symlinks
// are recreated, not followed, and listed in symlinks.txt; devices, FIFOs
// and sockets are skipped and listed there too.
func copyWorkspace(ws, dir string, m *manifest) error {
	// DynamicUser state directories are symlinks into /var/lib/private; the
	// top-level link is systemd's, not the agent's.
	real, err := filepath.EvalSymlinks(ws)
	if errors.Is(err, os.ErrNotExist) {
		return writeFile(dir, SymlinksName, []byte("# workspace "+ws+" does not exist\n"), m)
	}
	if err != nil {
		return fmt.Errorf("workspace: %w", err)
	}
	root, err := os.OpenRoot(real)
	if err != nil {
		return fmt.Errorf("workspace: %w", err)
	}
	defer root.Close()
	dstRoot := filepath.Join(dir, WorkspaceDir)
	if err := os.Mkdir(dstRoot, 0o700); err != nil {
		return err
	}
	var links bytes.Buffer
	err = fs.WalkDir(root.FS(), ".", func(rel string, de fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("workspace %s: %w", rel, err)
		}
		if rel == "." {
			return nil
		}
		dst := filepath.Join(dstRoot, filepath.FromSlash(rel))
		name := WorkspaceDir + "/" + rel
		switch t := de.Type(); {
		case t.IsDir():
			return os.Mkdir(dst, 0o700)
		case t&fs.ModeSymlink != 0:
			target, err := root.Readlink(rel)
			if err != nil {
				return fmt.Errorf("workspace %s: %w", rel, err)
			}
			fmt.Fprintf(&links, "%q -> %q\n", name, target)
			return os.Symlink(target, dst)
		case t.IsRegular():
			f, err := root.Open(rel)
			if err != nil {
				return fmt.Errorf("workspace %s: %w", rel, err)
			}
			defer f.Close()
			st, err := f.Stat()
			if err != nil || !st.Mode().IsRegular() {
				return fmt.Errorf("workspace %s: changed while copying", rel)
			}
			return copyStream(f, dst, st.Mode().Perm()&0o700|0o400, name, m)
		default:
			fmt.Fprintf(&links, "%q skipped (%s)\n", name, t)
			return nil
		}
	})
	if err != nil {
		return err
	}
	return writeFile(dir, SymlinksName, links.Bytes(), m)
}

// Verify re-hashes every file listed in dir's manifest (what `sha256sum -c`
// does) and reports the first mismatch.
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
			return fmt.Errorf("verify: %w", err)
		}
		h := sha256.New()
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return fmt.Errorf("verify %s: %w", name, err)
		}
		if hex.EncodeToString(h.Sum(nil)) != sum {
			return fmt.Errorf("verify: %s does not match the manifest", name)
		}
	}
	return nil
}
