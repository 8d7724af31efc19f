package relay

import (
	"context"
	"fmt"
	"strings"

	"github.com/nixcage/nixcage/internal/bus"
)

type turnJob struct {
	q    *request
	text string
}

// enqueueTurn queues a plain message as a turn of the chat's agent. Turns
// of one agent run one at a time, in the order they came; caged queues as
// well, this keeps the relay's order and its typing indicator honest.
func (r *Relay) enqueueTurn(ctx context.Context, q *request, text string) {
	r.mu.Lock()
	ch, ok := r.queues[q.agent]
	if !ok {
		ch = make(chan turnJob, turnQueue)
		r.queues[q.agent] = ch
		r.wg.Add(1)
		go r.turnWorker(ctx, ch)
	}
	r.mu.Unlock()
	select {
	case ch <- turnJob{q: q, text: text}:
	default:
		// Answered aside: enqueueTurn runs on the update loop.
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.answer(ctx, q, fmt.Sprintf("Refused: %d turns are already waiting for %s; send this again when it has answered.", turnQueue, q.agent))
			r.audit(ctx, q, "turn", bus.RelayRefused, "queue full")
		}()
	}
}

func (r *Relay) turnWorker(ctx context.Context, ch chan turnJob) {
	defer r.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case j := <-ch:
			r.runTurn(ctx, j)
		}
	}
}

func (r *Relay) runTurn(ctx context.Context, j turnJob) {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { r.typing(ctx, j.q, stop); close(done) }()
	res, err := r.caged.Turn(ctx, j.q.agent, j.text)
	close(stop)
	<-done
	if err != nil {
		o, det := r.refusal(ctx, j.q, "turn of "+j.q.agent, err)
		r.audit(ctx, j.q, "turn", o, det)
		return
	}
	out, outcome := res.Reply, bus.RelayOK
	if res.Status != bus.TurnSuccess {
		// The reply then ends with the harness's stderr (caged's side).
		out = fmt.Sprintf("%s\n\n[turn %s, exit status %d]", strings.TrimRight(out, "\n"), res.Status, res.Exit)
		outcome = bus.RelayFailed
	}
	r.answer(ctx, j.q, out)
	r.audit(ctx, j.q, "turn", outcome, fmt.Sprintf("%s, exit status %d, %d bytes in, %d bytes out", res.Status, res.Exit, len(j.text), len(res.Reply)))
}
