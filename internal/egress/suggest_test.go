package egress

import (
	"context"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/egress/dnsfilter"
	"github.com/nixcage/nixcage/internal/egress/netguard"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/suggest"
)

// TestSuggestTurnsARecordedRunIntoAPolicy: a run through the real gateway is
// refused, `policy suggest`'s builder reads the real audit file, the HCL it
// prints loads through the config loader (as `cagectl validate` does), and
// with its entries merged into the policy the same requests pass. Names
// resolving to private or metadata addresses, IP literals, shipped-deny names
// and the policy's own deny are refused in the run and never suggested.
func TestSuggestTurnsARecordedRunIntoAPolicy(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Allow = []string{"example.net"}
		rt.Policy.Ports = nil
		rt.Policy.Inspect = nil
		rt.Secrets = nil
	})
	h.dns.set("www.example.org", "A", "127.0.0.1")
	h.dns.set("statsig.com", "A", "127.0.0.1")
	c := h.client(false)
	run := func() map[string]int {
		got := map[string]int{}
		for _, u := range []string{h.httpURL("plain.example.com", "/a"), h.httpURL("www.example.org", "/b")} {
			st, _, _, err := h.do(c, http.MethodGet, u, nil, "")
			if err != nil {
				t.Fatal(err)
			}
			got[u] = st
		}
		for _, a := range []string{"other.example.com:" + strconv.Itoa(h.up.tlsPort), "private.example.com:443", "metadata.example.com:443", "127.0.0.1:443", "denied.example.com:443", "statsig.com:443"} {
			conn, st := h.connect(a, "")
			if conn != nil {
				conn.Close()
			}
			got[a] = st
		}
		return got
	}
	first := run()
	for k, st := range first {
		if st != http.StatusForbidden {
			t.Fatalf("before: %s got %d, want 403", k, st)
		}
	}
	h.want(t, is("CONNECT", "statsig.com", 443), "blocked", "default-deny")

	lines := auditLines(t, h.rt.AuditFile)
	guard := &netguard.Guard{UnsafeAllowLoopback: true}
	res := &dnsfilter.Resolver{Server: h.dns.addr}
	o := suggest.Options{
		Denies: config.NewLoader().BuiltinDenies(),
		Forbidden: suggest.Resolved(func(host string) ([]netip.Addr, error) {
			return res.LookupNetIP(context.Background(), "ip", host)
		}, func(a netip.Addr) string {
			if _, err := guard.Check(a); err != nil {
				return err.Error()
			}
			return ""
		}),
	}
	s := suggest.Build("alice", lines, o)
	out := s.HCL("alice-suggested")
	t.Logf("suggested:\n%s", out)
	var pats []string
	for _, e := range s.Entries {
		pats = append(pats, e.Pattern)
	}
	slices.Sort(pats)
	if want := []string{"other.example.com", "plain.example.com", "www.example.org"}; !slices.Equal(pats, want) {
		t.Fatalf("suggested %v, want %v", pats, want)
	}
	for _, never := range []string{"private.example.com", "metadata.example.com", "127.0.0.1", "denied.example.com", "statsig.com"} {
		if !strings.Contains(out, "# not suggested: "+never+" ") {
			t.Errorf("%s not listed as not suggested", never)
		}
		if strings.Contains(out, strconv.Quote(never)) {
			t.Errorf("%s suggested", never)
		}
	}

	cfg, diags := config.NewLoader().Load(config.Source{Name: "suggested.hcl", Data: []byte(out)})
	if diags.HasErrors() {
		t.Fatalf("suggested policy does not validate: %v", diags)
	}
	var sp *policy.Policy
	for i := range cfg.Policies {
		if cfg.Policies[i].Name == "alice-suggested" {
			sp = &cfg.Policies[i]
		}
	}
	if sp == nil {
		t.Fatalf("no policy alice-suggested in %+v", cfg.Policies)
	}
	if !slices.Contains(sp.Ports, h.up.tlsPort) || !slices.Contains(sp.Ports, h.up.httpPort) {
		t.Fatalf("suggested ports %v lack the upstream ports %d, %d", sp.Ports, h.up.tlsPort, h.up.httpPort)
	}

	// Apply: merge the suggestion into the agent's policy, restart.
	h.stop()
	h.rt.Policy.Allow = append(h.rt.Policy.Allow, sp.Allow...)
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, sp.Ports...)
	h.writeConfig(h.rt)
	h.start()
	c = h.client(false)
	second := run()
	for k, st := range second {
		want := http.StatusForbidden
		if strings.Contains(k, "plain.example.com") || strings.Contains(k, "www.example.org") || strings.HasPrefix(k, "other.example.com") {
			want = http.StatusOK
		}
		if st != want {
			t.Errorf("after: %s got %d, want %d", k, st, want)
		}
	}
}

func auditLines(t *testing.T, file string) []string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}
