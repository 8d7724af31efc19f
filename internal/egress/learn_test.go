package egress

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// learnRuntime is a policy that allows api.example.com only, in learn mode
// with a shipped deny list, so every other name the fakes know is unlisted.
func learnRuntime(forSeconds int64) func(rt *policy.Runtime) {
	return func(rt *policy.Runtime) {
		rt.Policy.Allow = []string{"api.example.com"}
		rt.Policy.Deny = []string{"denied.example.com"}
		rt.Learn = &policy.Learn{ForSeconds: forSeconds, File: filepath.Join(filepath.Dir(rt.ResolvConf), "learn.json"), Deny: []string{"telemetry.example.com"}}
	}
}

// learnNames are the names the fake DNS answers for the learn tests. The
// refused ones that resolve to 127.0.0.1 are what a plain allow-all would
// let through (the fake upstream listens there and the test policy allows
// loopback upstreams): only learn mode's own refusals stop them.
func learnNames(h *harness) {
	for _, n := range []string{"new", "telemetry", "denied"} {
		h.dns.set(n+".example.com", "A", "127.0.0.1")
	}
	h.dns.set("printer.local", "A", "127.0.0.1")
	h.dns.set("metadata.google.internal", "A", "169.254.169.254")
}

// TestLearnFromTheCage: learn mode in the production shape (the cage's own
// network namespace, the gateway socket-activated in the host namespace,
// curl and getent as the agent). An unlisted name goes through, flagged
// with rule learn, on CONNECT, plain HTTP and DNS; and everything the
// address rules or a deny list refuse is still refused, tried the way an
// agent would: names resolving to private and metadata addresses, address
// literals in every form, CONNECT to a literal, a Host header or SNI naming
// another host, denied, shipped-denied and special-use names. Each refusal
// is asserted by status, audit rule and the fake upstream not reached.
func TestLearnFromTheCage(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	getent := testenv.LookPath(t, "getent")
	h := setupHarness(t, learnRuntime(600))
	learnNames(h)
	agent, _ := startCage(t, h)
	tp, plain := strconv.Itoa(h.up.tlsPort), strconv.Itoa(h.up.httpPort)
	codeRE := regexp.MustCompile(`HTTPCODE=(\d+)`)
	get := func(url string, extra ...string) (int, string) {
		args := append([]string{curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", h.up.rootsFile, "-w", "\nHTTPCODE=%{http_code}\n"}, extra...)
		out, _ := agent(append(args, url)...)
		code := 0
		if m := codeRE.FindStringSubmatch(out); m != nil {
			code, _ = strconv.Atoi(m[1])
		}
		return code, out
	}
	h.want(t, func(r audit.Record) bool { return r.Event == audit.EventLearn }, audit.Flagged, policy.RuleLearn)

	t.Run("an unlisted name goes through, flagged", func(t *testing.T) {
		if code, out := get("https://new.example.com:" + tp + "/learned-tls"); code != 200 || !strings.Contains(out, "host=new.example.com") {
			t.Fatalf("CONNECT to an unlisted name in learn mode: %d\n%s", code, out)
		}
		r := h.want(t, func(r audit.Record) bool {
			return is("CONNECT", "new.example.com", h.up.tlsPort)(r) && r.Event == audit.EventOpen
		}, audit.Flagged, policy.RuleLearn)
		if !strings.Contains(r.Reason, "learn mode") {
			t.Fatalf("reason %q does not say learn mode", r.Reason)
		}
		h.want(t, closed("CONNECT", "new.example.com", h.up.tlsPort), audit.Flagged, policy.RuleLearn)
		if code, out := get("http://new.example.com:" + plain + "/learned-http"); code != 200 || h.up.lastSeen().Path != "/learned-http" {
			t.Fatalf("plain HTTP to an unlisted name in learn mode: %d\n%s", code, out)
		}
		h.want(t, is("GET", "new.example.com", h.up.httpPort), audit.Flagged, policy.RuleLearn)
		if out, err := agent(getent, "hosts", "new.example.com"); err != nil || !strings.Contains(out, "127.0.0.1") {
			t.Fatalf("DNS for an unlisted name in learn mode: %v\n%s", err, out)
		}
		h.want(t, is("DNS", "new.example.com", 53), audit.Flagged, policy.RuleLearn)
	})

	t.Run("learn never passes an address rule or a deny", func(t *testing.T) {
		cases := []struct {
			name, url, rule string
			extra           []string
		}{
			{"name resolving to a private address (plain HTTP)", "http://private.example.com:" + plain + "/p1", "address", nil},
			{"name resolving to a private address (CONNECT)", "https://private.example.com:" + tp + "/p2", "address", nil},
			{"name resolving to metadata (CONNECT)", "https://metadata.example.com:" + tp + "/p3", "address", nil},
			{"name resolving to metadata (plain HTTP)", "http://metadata.example.com/latest/meta-data/", "address", nil},
			{"cloud metadata name", "http://metadata.google.internal/computeMetadata/v1/", policy.RuleSpecialUse, nil},
			{"special-use name on loopback", "http://printer.local:" + plain + "/p4", policy.RuleSpecialUse, nil},
			{"metadata literal", "http://169.254.169.254/latest/meta-data/", "ip-literal", nil},
			{"loopback literal (plain HTTP)", "http://127.0.0.1:" + plain + "/p5", "ip-literal", nil},
			{"loopback literal (CONNECT)", "https://127.0.0.1:" + tp + "/p6", "ip-literal", []string{"-k"}},
			{"IPv4-mapped IPv6 literal", "http://[::ffff:127.0.0.1]:" + plain + "/p7", "ip-literal", nil},
			{"private literal (CONNECT)", "https://10.0.0.1/p8", "ip-literal", []string{"-k"}},
			{"policy deny entry", "http://denied.example.com:" + plain + "/p9", "deny:denied.example.com", nil},
			{"shipped deny list", "http://telemetry.example.com:" + plain + "/p10", "deny:telemetry.example.com", nil},
			{"shipped deny list (CONNECT)", "https://telemetry.example.com:" + tp + "/p11", "deny:telemetry.example.com", nil},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				before := h.up.lastSeen()
				code, out := get(c.url, c.extra...)
				if code == 200 {
					t.Fatalf("learn mode let %s through:\n%s", c.url, out)
				}
				if after := h.up.lastSeen(); after != before {
					t.Fatalf("the upstream was reached for %s (path %s)", c.url, after.Path)
				}
				recs := h.records(t)
				var last audit.Record
				for _, r := range recs {
					if r.Decision == audit.Blocked && r.Event == audit.EventRequest {
						last = r
					}
				}
				if last.Rule != c.rule || last.Decision != audit.Blocked {
					t.Fatalf("%s: last refusal %+v, want rule %s\n%s", c.url, last, c.rule, out)
				}
			})
		}
	})

	t.Run("a Host header or SNI naming another host gains nothing", func(t *testing.T) {
		// The decision is on the request's authority; the upstream hears
		// the decided name, never the agent's Host header.
		code, out := get("http://new.example.com:"+plain+"/host-trick", "-H", "Host: 169.254.169.254")
		if code == 200 {
			if s := h.up.lastSeen(); s.Path != "/host-trick" || strings.Contains(s.Host, "169.254") {
				t.Fatalf("upstream saw Host %q for path %s", s.Host, s.Path)
			}
		} else {
			t.Fatalf("plain request with a Host trick: %d\n%s", code, out)
		}
		// A tunnel to a learned name whose TLS names metadata.google.internal.
		err := inNetns(h.cageNetns, func() error {
			c, err := net.Dial("tcp", "127.0.0.1:3128")
			if err != nil {
				return err
			}
			defer c.Close()
			fmt.Fprintf(c, "CONNECT new.example.com:%s HTTP/1.1\r\nHost: new.example.com:%s\r\n\r\n", tp, tp)
			resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
			if err != nil || resp.StatusCode != 200 {
				return fmt.Errorf("CONNECT to a learned name: %v %v", resp, err)
			}
			if err := tlsThrough(c, "metadata.google.internal", &tls.Config{RootCAs: h.up.roots}); err == nil {
				return fmt.Errorf("TLS naming metadata.google.internal through a learned tunnel succeeded")
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		h.want(t, is("CONNECT", "new.example.com", h.up.tlsPort), audit.Blocked, "sni-mismatch")
	})

	t.Run("DNS in learn mode keeps the address and name rules", func(t *testing.T) {
		if out, err := agent(getent, "hosts", "private.example.com"); err == nil && strings.Contains(out, "10.1.2.3") {
			t.Fatalf("the cage got a private address for a learned name:\n%s", out)
		}
		r := h.want(t, is("DNS", "private.example.com", 53), audit.Flagged, policy.RuleLearn)
		if !strings.Contains(r.Reason, "dropped") {
			t.Fatalf("private answer not dropped: %q", r.Reason)
		}
		for name, rule := range map[string]string{"metadata.google.internal": policy.RuleSpecialUse, "telemetry.example.com": "deny:telemetry.example.com", "denied.example.com": "deny:denied.example.com"} {
			if out, err := agent(getent, "hosts", name); err == nil {
				t.Fatalf("%s resolved in learn mode:\n%s", name, out)
			}
			h.want(t, is("DNS", name, 53), audit.Blocked, rule)
		}
	})
}

// TestLearnKeepsLoopbackRefused: with the production address rules (no
// unsafe_allow_loopback_upstreams), a learned name resolving to loopback
// is refused: learn mode adds names, never addresses.
func TestLearnKeepsLoopbackRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the learn window file must be owned by root (uid 0); run as root")
	}
	h := newHarness(t, func(rt *policy.Runtime) {
		learnRuntime(600)(rt)
		rt.Policy.UnsafeAllowLoopbackUpstreams = false
	})
	learnNames(h)
	if _, code := h.connect("new.example.com:"+strconv.Itoa(h.up.tlsPort), ""); code != http.StatusForbidden {
		t.Fatalf("learned name on loopback: %d", code)
	}
	r := h.want(t, is("CONNECT", "new.example.com", h.up.tlsPort), audit.Blocked, "address")
	if !strings.Contains(r.Reason, "loopback") {
		t.Fatalf("reason %q", r.Reason)
	}
}

// TestLearnExpires: the window is the gateway's to enforce. Learned while
// open; once it ends, the same requests are refused (default-deny), the
// audit says learn mode ended, and a new request inside an intercepted
// tunnel opened while learning is refused too. A window stamp the gateway
// cannot trust (writable by others) is no learning at all.
func TestLearnExpires(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the learn window file must be owned by root (uid 0); run as root")
	}
	h := setupHarness(t, learnRuntime(600))
	learnNames(h)
	// Stamp a short window, as prepare would at the cage's start.
	now := time.Now()
	until := now.Add(4 * time.Second)
	stamp := func(mode os.FileMode) {
		b, _ := json.Marshal(policy.LearnWindow{Schema: policy.LearnSchema, Agent: "alice", StartedUnix: now.Unix() - 1, UntilUnix: until.Unix()})
		if err := os.WriteFile(h.rt.Learn.File, b, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(h.rt.Learn.File, mode); err != nil {
			t.Fatal(err)
		}
	}
	stamp(0o644)
	until = time.Unix(until.Unix(), 0)
	h.start()
	auth := "new.example.com:" + strconv.Itoa(h.up.tlsPort)
	c, code := h.connect(auth, "")
	if code != http.StatusOK {
		t.Fatalf("learned CONNECT: %d\n%s", code, h.dump())
	}
	c.Close()
	// other.example.com is intercepted (inspect), so requests inside its
	// tunnel are decided one by one.
	ic, code := h.connect("other.example.com:"+strconv.Itoa(h.up.tlsPort), "")
	if code != http.StatusOK {
		t.Fatalf("learned intercepted CONNECT: %d", code)
	}
	defer ic.Close()
	tc := tlsClient(ic, "other.example.com", h)
	br := bufio.NewReader(tc)
	if st := tlsGet(t, tc, br, "other.example.com"); st != http.StatusOK {
		t.Fatalf("request in a learned intercepted tunnel: %d", st)
	}
	h.want(t, func(r audit.Record) bool { return is("GET", "other.example.com", 0)(r) }, audit.Flagged, policy.RuleLearn)

	time.Sleep(time.Until(until))
	h.pollConnect(t, auth, http.StatusForbidden)
	h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "new.example.com", h.up.tlsPort)(r) && r.Decision == audit.Blocked
	}, audit.Blocked, "default-deny")
	r := h.want(t, func(r audit.Record) bool { return r.Event == audit.EventLearn && strings.Contains(r.Reason, "ended") }, audit.Allowed, policy.RuleLearn)
	if !strings.Contains(r.Reason, "policy applies again") {
		t.Fatalf("end record %q", r.Reason)
	}
	if st := tlsGet(t, tc, br, "other.example.com"); st != http.StatusForbidden {
		t.Fatalf("request in a learned tunnel after the window: %d", st)
	}

	// A stamp others may write is not trusted: a restarted gateway does
	// not learn, whatever the stamp says.
	h.stop()
	until = time.Now().Add(time.Hour)
	stamp(0o666)
	h.start()
	if _, code := h.connect(auth, ""); code != http.StatusForbidden {
		t.Fatalf("untrusted learn stamp honoured: %d", code)
	}
	if !h.logged("learn mode refused") {
		t.Errorf("untrusted learn stamp not logged")
	}
}

// tlsClient is TLS to host through an intercepted tunnel (the cage CA).
func tlsClient(c net.Conn, host string, h *harness) *tls.Conn {
	return tls.Client(c, &tls.Config{ServerName: host, RootCAs: h.cagePool})
}
