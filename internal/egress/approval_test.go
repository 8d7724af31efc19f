package egress

import (
	"crypto/tls"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// approvalRuntime: api.example.com allowed, everything else waits up to
// wait for an operator, at most two distinct requests at once.
func approvalRuntime(wait int64) func(rt *policy.Runtime) {
	return func(rt *policy.Runtime) {
		rt.Policy.Allow = []string{"api.example.com"}
		dir := filepath.Dir(rt.ResolvConf)
		rt.Approval = &policy.Approval{WaitSeconds: wait, MaxPending: 2,
			PendingDir: filepath.Join(filepath.Dir(dir), "pending"), DecisionsDir: filepath.Join(dir, "approvals")}
		for _, d := range []string{rt.Approval.PendingDir, rt.Approval.DecisionsDir} {
			os.MkdirAll(d, 0o755)
			os.Chmod(d, 0o755)
		}
	}
}

// pendingNow reads the pending directory as caged does (ParsePending).
func pendingNow(t *testing.T, a *policy.Approval) []*policy.Pending {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(a.PendingDir, "a-*.json"))
	var out []*policy.Pending
	for _, f := range m {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // removed meanwhile
		}
		p, err := policy.ParsePending(b, "alice")
		if err != nil {
			t.Fatalf("pending file %s does not parse as caged reads it: %v\n%s", f, err, b)
		}
		out = append(out, p)
	}
	return out
}

// waitPending waits for the pending request for host.
func waitPending(t *testing.T, a *policy.Approval, host string) *policy.Pending {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for _, p := range pendingNow(t, a) {
			if p.Host == host {
				return p
			}
		}
	}
	t.Fatalf("no pending approval for %s", host)
	return nil
}

// decide writes an operator's decision as caged does.
func decide(t *testing.T, a *policy.Approval, p *policy.Pending, verdict, by string) {
	t.Helper()
	b, _ := policy.MarshalDoc(&policy.ApprovalDecision{Schema: policy.ApprovalSchema, ID: p.ID, Agent: "alice", Verdict: verdict, By: by, DecidedUnix: time.Now().Unix()})
	if err := policy.WriteFileAtomic(a.DecisionFile(p.ID), b); err != nil {
		t.Fatal(err)
	}
}

// TestApprovalQueue: the real gateway with an approval queue, the test in
// caged's place reading pending files with caged's parser and writing
// decisions with caged's writer. An approval in time lets the request
// through (audited approval:ID, by whom); no decision refuses it after the
// wait, readably; a deny refuses it and the next retry without asking; a
// flood of distinct hosts is bounded (and of one host, joined); a literal,
// a deny entry or a special-use name is never put to an operator, and an
// approved name on a private address is refused by the address rules; a
// decision in a directory others may write approves nothing.
func TestApprovalQueue(t *testing.T) {
	testenv.RequirePrivileged(t)
	const wait = 4
	h := newHarness(t, approvalRuntime(wait))
	ap := h.rt.Approval
	h.dns.set("new.example.com", "A", "127.0.0.1")
	for i := range 6 {
		h.dns.set("flood"+strconv.Itoa(i)+".example.com", "A", "127.0.0.1")
	}
	tp := strconv.Itoa(h.up.tlsPort)

	t.Run("approved in time", func(t *testing.T) {
		done := make(chan int, 1)
		go func() {
			c, code := h.connect("new.example.com:"+tp, "")
			if c != nil {
				if err := tlsThrough(c, "new.example.com", &tls.Config{RootCAs: h.up.roots}); err != nil {
					code = -1
				}
				c.Close()
			}
			done <- code
		}()
		p := waitPending(t, ap, "new.example.com")
		if p.Method != "CONNECT" || p.Port != h.up.tlsPort || p.ExpiresUnix-p.SinceUnix != wait {
			t.Fatalf("pending %+v", p)
		}
		decide(t, ap, p, policy.VerdictOnce, "operator (uid 1000)")
		if code := <-done; code != http.StatusOK {
			t.Fatalf("approved CONNECT: %d\n%s", code, h.dump())
		}
		r := h.want(t, func(r audit.Record) bool {
			return is("CONNECT", "new.example.com", h.up.tlsPort)(r) && r.Event == audit.EventOpen
		}, audit.Allowed, "approval:"+p.ID)
		if !strings.Contains(r.Reason, "approved once by operator (uid 1000)") {
			t.Fatalf("open record does not say who approved: %q", r.Reason)
		}
		h.want(t, closed("CONNECT", "new.example.com", h.up.tlsPort), audit.Allowed, "approval:"+p.ID)
		if len(pendingNow(t, ap)) != 0 {
			t.Fatal("pending file left after the decision")
		}
		// Once means once: the next request asks again.
		go func() {
			code, _, _, _ := h.do(h.client(false), "GET", h.httpURL("new.example.com", "/again"), nil, "")
			done <- code
		}()
		p2 := waitPending(t, ap, "new.example.com")
		if p2.ID == p.ID || p2.Path != "/again" || p2.Method != "GET" {
			t.Fatalf("second pending %+v", p2)
		}
		decide(t, ap, p2, policy.VerdictOnce, "operator (uid 1000)")
		if code := <-done; code != http.StatusOK || lastPath(h) != "/again" {
			t.Fatalf("approved GET: %d", code)
		}
		if rec := h.want(t, is("GET", "new.example.com", h.up.httpPort), audit.Allowed, "approval:"+p2.ID); !strings.Contains(rec.Reason, "approved once by operator (uid 1000)") || !strings.Contains(rec.Reason, "200") {
			t.Fatalf("request record %q", rec.Reason)
		}
	})

	t.Run("timed out", func(t *testing.T) {
		start := time.Now()
		code, hdr, body, err := h.do(h.client(false), "GET", h.httpURL("new.example.com", "/nobody-there"), nil, "")
		if err != nil || code != http.StatusForbidden || hdr.Get("X-Nixcage-Rule") != policy.RuleApprovalTimeout || !strings.Contains(body, "timed out") || !strings.Contains(body, "waiting for an operator's approval") {
			t.Fatalf("timed-out request: %d %v %q %v", code, hdr, body, err)
		}
		if time.Since(start) < wait*time.Second-time.Second {
			t.Fatalf("refused after %s, before the wait of %ds", time.Since(start), wait)
		}
		r := h.want(t, is("GET", "new.example.com", h.up.httpPort), audit.Blocked, policy.RuleApprovalTimeout)
		if !strings.Contains(r.Reason, "timed out") {
			t.Fatalf("reason %q", r.Reason)
		}
		if lastPath(h) == "/nobody-there" {
			t.Fatal("the upstream was reached")
		}
	})

	t.Run("denied, and not asked again at once", func(t *testing.T) {
		done := make(chan string, 1)
		go func() {
			_, _, body, _ := h.do(h.client(false), "GET", h.httpURL("new.example.com", "/deny-me"), nil, "")
			done <- body
		}()
		p := waitPending(t, ap, "new.example.com")
		decide(t, ap, p, policy.VerdictDeny, "operator (uid 1000)")
		if body := <-done; !strings.Contains(body, "denied by operator (uid 1000)") || !strings.Contains(body, policy.RuleApprovalDenied) {
			t.Fatalf("denial body %q", body)
		}
		h.want(t, is("GET", "new.example.com", h.up.httpPort), audit.Blocked, policy.RuleApprovalDenied)
		start := time.Now()
		code, _, body, _ := h.do(h.client(false), "GET", h.httpURL("new.example.com", "/retry"), nil, "")
		if code != http.StatusForbidden || !strings.Contains(body, "not asking again") || time.Since(start) > 2*time.Second {
			t.Fatalf("retry after a deny: %d %q after %s", code, body, time.Since(start))
		}
		if n := len(pendingNow(t, ap)); n != 0 {
			t.Fatalf("the retry asked again (%d pending)", n)
		}
	})

	t.Run("a flood is bounded", func(t *testing.T) {
		var wg sync.WaitGroup
		codes := make(chan int, 32)
		// Ten requests for one host join one pending request; a second
		// host takes the other slot.
		for i := range 12 {
			host := "flood0.example.com"
			if i >= 10 {
				host = "flood1.example.com"
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				code, _, _, _ := h.do(h.client(false), "GET", h.httpURL(host, "/f"+strconv.Itoa(i)), nil, "")
				codes <- code
			}()
		}
		waitPending(t, ap, "flood0.example.com")
		waitPending(t, ap, "flood1.example.com")
		if n := len(pendingNow(t, ap)); n != 2 {
			t.Fatalf("%d pending files for two hosts", n)
		}
		// Further distinct hosts are refused at once, nothing written.
		for i := 2; i < 6; i++ {
			start := time.Now()
			code, hdr, _, _ := h.do(h.client(false), "GET", h.httpURL("flood"+strconv.Itoa(i)+".example.com", "/over"), nil, "")
			if code != http.StatusForbidden || hdr.Get("X-Nixcage-Rule") != policy.RuleApprovalQueueFull || time.Since(start) > 2*time.Second {
				t.Fatalf("request over max_pending: %d %s after %s", code, hdr.Get("X-Nixcage-Rule"), time.Since(start))
			}
			if n := len(pendingNow(t, ap)); n > 2 {
				t.Fatalf("%d pending files, max_pending 2", n)
			}
		}
		h.want(t, is("GET", "flood5.example.com", h.up.httpPort), audit.Blocked, policy.RuleApprovalQueueFull)
		// One approval for the joined host lets its ten waiters through.
		for _, p := range pendingNow(t, ap) {
			if p.Host == "flood0.example.com" {
				decide(t, ap, p, policy.VerdictOnce, "operator (uid 1000)")
			}
		}
		wg.Wait()
		close(codes)
		ok, refused := 0, 0
		for c := range codes {
			if c == http.StatusOK {
				ok++
			} else {
				refused++
			}
		}
		if ok != 10 || refused != 2 {
			t.Fatalf("joined waiters: %d allowed, %d refused; want 10 and 2 (the undecided host timed out)", ok, refused)
		}
	})

	t.Run("never asked: literals, deny entries, special-use names", func(t *testing.T) {
		for _, u := range []string{"http://169.254.169.254/latest/", h.httpURL("denied.example.com", "/x"), "http://printer.local/"} {
			start := time.Now()
			code, hdr, _, _ := h.do(h.client(false), "GET", u, nil, "")
			if code != http.StatusForbidden || time.Since(start) > 2*time.Second {
				t.Fatalf("%s: %d (%s) after %s", u, code, hdr.Get("X-Nixcage-Rule"), time.Since(start))
			}
			if strings.HasPrefix(hdr.Get("X-Nixcage-Rule"), "approval") {
				t.Fatalf("%s was put to an operator: %s", u, hdr.Get("X-Nixcage-Rule"))
			}
		}
		if n := len(pendingNow(t, ap)); n != 0 {
			t.Fatalf("%d pending for requests no operator may allow", n)
		}
	})

	// A name is resolved only once approved (a lookup would carry the
	// agent's labels out: TestApprovalAsksBeforeResolving), so a name on
	// a private or metadata address is asked about, and the approval
	// still reaches nothing: the address rules refuse it.
	t.Run("approved names on private addresses are refused", func(t *testing.T) {
		for _, host := range []string{"private.example.com", "metadata.example.com"} {
			done := make(chan string, 1)
			go func() {
				code, hdr, _, _ := h.do(h.client(false), "GET", h.httpURL(host, "/private"), nil, "")
				done <- strconv.Itoa(code) + " " + hdr.Get("X-Nixcage-Rule")
			}()
			p := waitPending(t, ap, host)
			decide(t, ap, p, policy.VerdictOnce, "operator (uid 1000)")
			if got := <-done; got != "403 address" {
				t.Fatalf("approved %s: %s, want 403 address", host, got)
			}
			if lastPath(h) == "/private" {
				t.Fatalf("the upstream was reached through %s", host)
			}
		}
	})

	t.Run("a decision others could write approves nothing", func(t *testing.T) {
		done := make(chan int, 1)
		go func() {
			code, _, _, _ := h.do(h.client(false), "GET", h.httpURL("flood3.example.com", "/forged"), nil, "")
			done <- code
		}()
		p := waitPending(t, ap, "flood3.example.com")
		// The decisions directory made writable by others (as if the
		// gateway's user or the cage could write there): not trusted.
		if err := os.Chmod(ap.DecisionsDir, 0o777); err != nil {
			t.Fatal(err)
		}
		defer os.Chmod(ap.DecisionsDir, 0o755)
		decide(t, ap, p, policy.VerdictOnce, "forged")
		if code := <-done; code == http.StatusOK {
			t.Fatal("a decision in a directory others may write was honoured")
		}
		if lastPath(h) == "/forged" {
			t.Fatal("the upstream was reached")
		}
	})
}

// lastPath is the path of the upstream's last request, "" before any.
func lastPath(h *harness) string {
	if s := h.up.lastSeen(); s != nil {
		return s.Path
	}
	return ""
}
