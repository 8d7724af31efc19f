package store

import (
	"bufio"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sigstore/sigstore/pkg/cryptoutils"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

const (
	crashEnvRoot = "NIXCAGE_CRASH_ROOT"
	crashEnvRel  = "NIXCAGE_CRASH_RELEASE"
	crashEnvPub  = "NIXCAGE_CRASH_PUB"
	crashEnvStep = "NIXCAGE_CRASH_STEP"
	crashEnvName = "NIXCAGE_CRASH_AT" // kill at the first crash point of this name
)

// TestCrashChild is the process the crash test kills: it applies one
// release and, if asked, SIGKILLs itself at the N-th crash point.
func TestCrashChild(t *testing.T) {
	root := os.Getenv(crashEnvRoot)
	if root == "" {
		t.Skip("helper process for TestCrashSafety")
	}
	step, _ := strconv.Atoi(os.Getenv(crashEnvStep))
	at := os.Getenv(crashEnvName)
	n := 0
	crashPoint = func(name string) {
		if (at == "" && n == step) || (at != "" && name == at) {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Hour)
		}
		n++
	}
	s, err := Open(Options{Root: root, Channel: "stable", TrustedKeys: []string{os.Getenv(crashEnvPub)}, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("started\n")
	if _, err := s.Apply(context.Background(), release.DirSource(os.Getenv(crashEnvRel))); err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("done " + strconv.Itoa(n) + "\n")
}

// linkRelease makes the release dir for generation gen from base: cache
// files are hard links, only the manifest and signatures are new.
func linkRelease(t *testing.T, f *fixture, base, dir string, gen uint64) {
	t.Helper()
	must(t, filepath.Walk(base, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(base, p)
		if fi.IsDir() {
			return os.MkdirAll(filepath.Join(dir, rel), 0o755)
		}
		if rel == release.ManifestFile || rel == release.SignaturesFile {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(dir, rel), b, 0o644)
		}
		return os.Link(p, filepath.Join(dir, rel))
	}))
	releasetest.Resign(t, dir, []*release.PrivateKey{f.key}, func(m *release.Manifest) { m.Generation = gen })
}

// TestCrashSafety SIGKILLs applies at every injected crash point and at
// random moments. After each kill, recovery must leave current at the old
// or the new generation, complete and verifying, never a mixture. Releases
// alternate between closures A and B on a Keep=1 store, so every apply
// unpacks, renames, prunes and collects.
func TestCrashSafety(t *testing.T) {
	f := getFixture(t)
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	defer removeAll(root)
	pubPEM, err := cryptoutils.MarshalPublicKeyToPEM(f.pub.Key)
	must(t, err)
	pub := filepath.Join(dir, "release.pub")
	must(t, os.WriteFile(pub, pubPEM, 0o644))
	tops := map[uint64]string{}
	relFor := func(gen uint64) string {
		d := filepath.Join(dir, "rel-"+strconv.FormatUint(gen, 10))
		if _, err := os.Stat(d); err == nil {
			return d
		}
		base, top := f.relA, f.topA
		if gen%2 == 0 {
			base, top = f.relB, f.topB
		}
		linkRelease(t, f, base, d, gen)
		tops[gen] = top
		return d
	}
	child := func(gen uint64, step int) (*exec.Cmd, *bufio.Reader) {
		return crashChild(t, root, relFor(gen), pub, crashEnvStep+"="+strconv.Itoa(step))
	}

	// Generations 1 and 2 applied cleanly: the second apply also prunes
	// and collects, so it passes every crash point; it also times an
	// apply, the range for random kills.
	cmd, out := child(1, -1)
	lines, _ := readAllLines(out)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("clean apply: %v %v", err, lines)
	}
	start := time.Now()
	cmd, out = child(2, -1)
	lines, _ = readAllLines(out)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("clean apply: %v %v", err, lines)
	}
	applyTime := time.Since(start)
	points := 0
	for _, l := range lines {
		if n, ok := strings.CutPrefix(l, "done "); ok {
			points, _ = strconv.Atoi(n)
		}
	}
	if points < 8 {
		t.Fatalf("only %d crash points seen: %v", points, lines)
	}

	s, err := Open(Options{Root: root, Channel: "stable", Keys: []*release.PublicKey{f.pub}, Keep: 1})
	must(t, err)
	rng := rand.New(rand.NewPCG(1, uint64(time.Now().UnixNano())))
	const iterations = 60
	outcomes := map[string]int{}
	for i := range iterations {
		old, err := s.Current()
		must(t, err)
		gen := old + 1
		step := -1
		if i%2 == 0 {
			step = (i / 2) % points
		}
		cmd, out := child(gen, step)
		if step < 0 {
			if l, _ := out.ReadString('\n'); l != "started\n" {
				t.Fatalf("child did not start: %q", l)
			}
			time.Sleep(time.Duration(rng.Int64N(int64(applyTime))))
			cmd.Process.Kill()
		}
		readAllLines(out)
		werr := cmd.Wait()

		// What caged does at start: recover, then the store must verify.
		// A child killed while forking xz leaves the fork holding the lock
		// until it execs (close-on-exec): wait for that, briefly.
		err = s.Recover()
		for try := 0; err != nil && strings.Contains(err.Error(), "is busy") && try < 50; try++ {
			time.Sleep(100 * time.Millisecond)
			err = s.Recover()
		}
		if err != nil {
			t.Fatalf("iteration %d (step %d): recover: %v", i, step, err)
		}
		cur, err := s.Current()
		must(t, err)
		switch cur {
		case old:
			outcomes["old"]++
		case gen:
			outcomes["new"]++
		default:
			t.Fatalf("iteration %d: current %d, want %d or %d", i, cur, old, gen)
		}
		if werr == nil && cur != gen {
			t.Fatalf("iteration %d: apply finished but current is %d", i, cur)
		}
		m, err := s.manifest(cur)
		must(t, err)
		if m.Top != tops[cur] {
			t.Fatalf("iteration %d: generation %d names top %s, want %s (a mixture)", i, cur, m.Top, tops[cur])
		}
		if rep, err := s.Verify(context.Background(), true); err != nil {
			t.Fatalf("iteration %d (step %d, killed=%v): %v %v", i, step, werr != nil, err, rep.Problems)
		}
		if h, _ := s.Highest(); h < cur {
			t.Fatalf("iteration %d: highest %d below current %d", i, h, cur)
		}
	}
	t.Logf("%d kills, %d crash points, apply ~%v: %v", iterations, points, applyTime, outcomes)
	if outcomes["old"] == 0 || outcomes["new"] == 0 {
		t.Fatalf("kills never landed on both sides of the switch: %v", outcomes)
	}
}

// crashChild starts TestCrashChild applying rel to root.
func crashChild(t *testing.T, root, rel, pub, kill string) (*exec.Cmd, *bufio.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashEnvRoot+"="+root, crashEnvRel+"="+rel, crashEnvPub+"="+pub, kill)
	out, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	return cmd, bufio.NewReader(out)
}

// TestCrashAtEachStep SIGKILLs an apply at each named step boundary
// (unpack, rename, generation written, switch, state recorded, prune, gc)
// and asserts the exact side of the commit point it leaves: the previous
// generation before the switch, the new one from the switch on, and a
// store that recovers and verifies either way.
func TestCrashAtEachStep(t *testing.T) {
	f := getFixture(t)
	dir := t.TempDir()
	pubPEM, err := cryptoutils.MarshalPublicKeyToPEM(f.pub.Key)
	must(t, err)
	pub := filepath.Join(dir, "release.pub")
	must(t, os.WriteFile(pub, pubPEM, 0o644))
	rel1, rel2 := filepath.Join(dir, "1"), filepath.Join(dir, "2")
	linkRelease(t, f, f.relB, rel1, 1)
	linkRelease(t, f, f.relA, rel2, 2)
	for _, b := range stepBoundaries {
		t.Run(b.point, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "root")
			defer removeAll(root)
			s, err := Open(Options{Root: root, Channel: "stable", Keys: []*release.PublicKey{f.pub}, Keep: 1})
			must(t, err)
			if _, err := applyDir(t, s, rel1); err != nil {
				t.Fatal(err)
			}
			cmd, out := crashChild(t, root, rel2, pub, crashEnvName+"="+b.point)
			lines, _ := readAllLines(out)
			werr := cmd.Wait()
			var ee *exec.ExitError
			if !errors.As(werr, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
				t.Fatalf("child was not killed at %s: %v %v", b.point, werr, lines)
			}
			must(t, s.Recover())
			cur, err := s.Current()
			must(t, err)
			want := uint64(2)
			if b.preCommit {
				want = 1
			}
			if cur != want {
				t.Fatalf("killed at %s: current %d, want %d", b.point, cur, want)
			}
			if h, _ := s.Highest(); h != want {
				t.Fatalf("killed at %s: highest %d, want %d", b.point, h, want)
			}
			if rep, err := s.Verify(context.Background(), true); err != nil {
				t.Fatalf("killed at %s: %v %v", b.point, err, rep.Problems)
			}
			// An apply that was cut before the switch can be redone.
			if b.preCommit {
				if _, err := applyDir(t, s, rel2); err != nil {
					t.Fatalf("apply again after a kill at %s: %v", b.point, err)
				}
			}
		})
	}
}

func readAllLines(r *bufio.Reader) ([]string, error) {
	var out []string
	for {
		l, err := r.ReadString('\n')
		if l != "" {
			out = append(out, strings.TrimSpace(l))
		}
		if err != nil {
			return out, err
		}
	}
}
