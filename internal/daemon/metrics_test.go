package daemon_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/testenv"
)

// freePort is a loopback TCP port nobody listens on right now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// appendAudit writes gateway audit records for agent as the gateway does:
// one JSON line each, appended.
func appendAudit(t *testing.T, c *daemontest.Caged, agent string, recs ...auditlog.Record) {
	t.Helper()
	file := c.Path(filepath.Join(paths.AuditDir(agent), "audit.jsonl"))
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, r := range recs {
		r.Schema, r.Agent, r.TS = auditlog.Schema, agent, time.Now().UTC().Format(time.RFC3339Nano)
		b, _ := json.Marshal(r)
		if _, err := f.Write(append(b, '\n')); err != nil {
			t.Fatal(err)
		}
	}
}

// A real Prometheus (Debian's package) scrapes caged's endpoint; after the
// gateway's audit log gains blocked and allowed records, Prometheus' own
// query API reports them per agent and decision, with the bytes, the unit
// state and the gateway.
func TestPrometheusScrapesCaged(t *testing.T) {
	prom := testenv.LookPath(t, "prometheus")
	mport, pport := freePort(t), freePort(t)
	c := daemontest.Start(t, twoAgents+fmt.Sprintf("metrics {\n  listen = \"127.0.0.1:%d\"\n}\n", mport))

	appendAudit(t, c, "alpha",
		auditlog.Record{Event: auditlog.EventRequest, Method: "CONNECT", Host: "evil.example", Port: 443, Decision: auditlog.Blocked, Reason: "host not allowed"},
		auditlog.Record{Event: auditlog.EventRequest, Method: "CONNECT", Host: "evil.example", Port: 443, Decision: auditlog.Blocked, Reason: "host not allowed"},
		auditlog.Record{Event: auditlog.EventOpen, Method: "CONNECT", Host: "api.example.com", Port: 443, Decision: auditlog.Allowed},
		auditlog.Record{Event: auditlog.EventClose, Method: "CONNECT", Host: "api.example.com", Port: 443, Decision: auditlog.Allowed, BytesOut: 1200, BytesIn: 34000},
	)

	dir := t.TempDir()
	cfg := fmt.Sprintf("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: caged\n    static_configs:\n      - targets: ['127.0.0.1:%d']\n", mport)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, prom, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), fmt.Sprintf("--web.listen-address=127.0.0.1:%d", pport))
	var plog strings.Builder
	cmd.Stdout, cmd.Stderr = &plog, &plog
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); cmd.Wait() }()

	query := func(q string) (map[string]string, string, bool) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/api/v1/query?query=%s", pport, url.QueryEscape(q)))
		if err != nil {
			return nil, "", false
		}
		defer resp.Body.Close()
		var r struct {
			Status string
			Data   struct {
				Result []struct {
					Metric map[string]string
					Value  [2]any
				}
			}
		}
		if b, _ := io.ReadAll(resp.Body); json.Unmarshal(b, &r) != nil || r.Status != "success" || len(r.Data.Result) != 1 {
			return nil, "", false
		}
		v, _ := r.Data.Result[0].Value[1].(string)
		return r.Data.Result[0].Metric, v, true
	}
	want := map[string]string{
		`nixcage_requests_total{agent="alpha",decision="blocked"}`:   "2",
		`nixcage_requests_total{agent="alpha",decision="allowed"}`:   "1",
		`nixcage_requests_total{agent="beta",decision="blocked"}`:    "0",
		`nixcage_egress_bytes_total{agent="alpha",direction="up"}`:   "1200",
		`nixcage_egress_bytes_total{agent="alpha",direction="down"}`: "34000",
		`nixcage_agent_state{agent="alpha",state="active"}`:          "1",
		`nixcage_agent_state{agent="beta",state="inactive"}`:         "1",
		`nixcage_agent_quarantined{agent="alpha"}`:                   "0",
		`nixcage_store_generation`:                                   "0",
		`up{job="caged"}`:                                            "1",
	}
	deadline := time.Now().Add(60 * time.Second)
	for q, v := range want {
		for {
			m, got, ok := query(q)
			if ok && got == v {
				if strings.HasPrefix(q, "nixcage_requests_total") && m["job"] != "caged" {
					t.Fatalf("%s came from job %q", q, m["job"])
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("Prometheus query %s = %q (found %v), want %s\nprometheus log:\n%s", q, got, ok, v, plog.String())
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	// No store generation: no expiry series (not a made-up 0).
	if _, _, ok := query(`nixcage_release_expiry_seconds`); ok {
		t.Error("release expiry reported without a store generation")
	}
}

// A unix socket endpoint under caged's runtime directory serves the same
// exposition; without a metrics block nothing listens.
func TestMetricsOnUnixSocket(t *testing.T) {
	c := daemontest.Start(t, twoAgents+"metrics {\n  listen = \"unix:/run/nixcage/metrics.sock\"\n}\n")
	appendAudit(t, c, "alpha", auditlog.Record{Event: auditlog.EventRequest, Method: "GET", Host: "evil.example", Decision: auditlog.Blocked})
	sock := c.Path("/run/nixcage/metrics.sock")
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	deadline := time.Now().Add(20 * time.Second)
	for {
		body := ""
		if resp, err := hc.Get("http://caged/metrics"); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
		}
		if strings.Contains(body, `nixcage_requests_total{agent="alpha",decision="blocked"} 1`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics over %s never showed the blocked request:\n%s", sock, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket mode: %v %v", fi, err)
	}

	d := daemontest.Start(t, twoAgents)
	if _, err := os.Stat(d.Path("/run/nixcage/metrics.sock")); err == nil {
		t.Fatal("metrics socket exists without a metrics block")
	}
}
