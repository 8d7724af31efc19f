package daemon

import (
	"context"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
)

// A gateway that crashes again and again (an OOM kill loop, a broken
// config after an update) hits systemd's start limit: systemd stops
// restarting it and fails its sockets. The cage is then cut off, which is
// right (fail closed), but nothing would say so: the agent's own unit is
// still running. caged reads the gateway's and its proxy socket's Result
// when either is failed, shows it as the agent's egress state in Status and
// signals EgressFailed once per failure. docs/operations.md says how to
// recover (`cagectl restart AGENT`).

// StartLimitHit is the egress state of an agent whose gateway hit its
// start limit.
const StartLimitHit = "failed: start limit hit"

// egressUnits are the units whose failure cuts the cage off.
func egressUnits(agent string) (service, socket string) {
	return paths.Instance(paths.EgressTemplate, agent), paths.Instance(paths.ProxySocketTpl, agent)
}

// egressFailure says why an agent's egress is down, from the units' states
// and (for failed ones) systemd's Result; "" when it is not failed. On
// systemd 252 the start limit shows on the socket (Result
// service-start-limit-hit) while the service keeps Result exit-code; the
// service's own start-limit-hit is checked too, for a gateway started
// without its socket.
func (d *Daemon) egressFailure(ctx context.Context, agent string, states map[string]reconcile.State) string {
	svc, sock := egressUnits(agent)
	if states[svc].Active != "failed" && states[sock].Active != "failed" {
		return ""
	}
	result := func(unit, typ string) string {
		props, err := d.sd.GetUnitTypePropertiesContext(ctx, unit, typ)
		if err != nil {
			return ""
		}
		r, _ := props["Result"].(string)
		return r
	}
	sr, kr := result(svc, "Service"), result(sock, "Socket")
	switch {
	case sr == "start-limit-hit" || kr == "service-start-limit-hit" || kr == "trigger-limit-hit":
		return StartLimitHit
	case sr != "" && sr != "success":
		return "failed: " + sr
	case kr != "" && kr != "success":
		return "failed: socket " + kr
	}
	return "failed"
}

// noteEgress records agent's egress failure and signals a new one.
func (d *Daemon) noteEgress(agent, failure string) {
	d.mu.Lock()
	prev := d.egressFail[agent]
	if failure == "" {
		delete(d.egressFail, agent)
	} else {
		d.egressFail[agent] = failure
	}
	d.mu.Unlock()
	if failure != "" && failure != prev {
		d.log.Error("gateway failed; the cage has no network until it is restarted", "agent", agent, "state", failure, "recover", "cagectl restart "+agent)
		if d.srv != nil {
			d.emit(bus.SignalEgressFailed, agent, "gateway "+failure, "cagectl restart "+agent)
		}
	}
}
