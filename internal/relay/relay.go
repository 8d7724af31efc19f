// Package relay is cage-relay: it carries commands from a Telegram chat
// to caged and answers back. It holds the bot token and nothing else; every
// action goes to caged over the system bus as the relay's declared account,
// so caged decides (and a compromised relay can do no more than that
// account may). Commands flow one way, chat -> relay -> caged -> cage.
//
// Only owners (configured Telegram user ids) are served; everyone else is
// refused. Each agent answers in its own chat (or forum topic). Every
// action is audited: to the relay's journal, and as a RelayAction event
// through caged (`cagectl events`). docs/relay.md is the user's side.
package relay

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/go-telegram/bot/models"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/relay/tg"
)

// Relay routes updates from one bot to caged.
type Relay struct {
	doc    config.RelayDoc
	tg     *tg.Client
	caged  Caged
	log    *slog.Logger
	owners map[int64]bool

	// TypingEvery is how often "typing" is re-sent while a turn runs
	// (Telegram shows it for about 5 s).
	TypingEvery time.Duration
	// Tmp is where downloads and unpacked releases go (default: $TMPDIR,
	// the unit's PrivateTmp=).
	Tmp string

	mu      sync.Mutex
	queues  map[string]chan turnJob // per agent: turns run one at a time, in order
	refused map[refusalKey]time.Time
	wg      sync.WaitGroup
}

type refusalKey struct{ user, chat int64 }

// Limits of the relay's own making.
const (
	// MaxAnswerMessages: an answer that would take more messages goes as
	// a file instead.
	MaxAnswerMessages = 3
	// turnQueue is how many turns may wait per agent: as many as caged
	// lets wait, so the relay never sends one caged would refuse as busy.
	turnQueue = bus.MaxQueuedTurns
	// refusalQuiet: a non-owner is told "refused" once in this time per
	// chat (each attempt is still audited), so strangers cannot use the
	// bot's send budget against the owners.
	refusalQuiet = 10 * time.Minute
	// DefaultTypingEvery is under Telegram's ~5 s display of an action.
	DefaultTypingEvery = 4 * time.Second
)

// New makes a relay for doc, talking to Telegram through t and to caged
// through c.
func New(doc config.RelayDoc, t *tg.Client, c Caged, log *slog.Logger) *Relay {
	if log == nil {
		log = slog.Default()
	}
	r := &Relay{doc: doc, tg: t, caged: c, log: log, owners: map[int64]bool{}, TypingEvery: DefaultTypingEvery,
		queues: map[string]chan turnJob{}, refused: map[refusalKey]time.Time{}}
	for _, o := range doc.Owners {
		r.owners[o] = true
	}
	return r
}

// Serve handles updates until ctx ends, then waits for running handlers.
func (r *Relay) Serve(ctx context.Context) error {
	defer r.wg.Wait()
	// Subscribed before the first update is read, so a request waiting
	// from then on is announced in its agent's chat.
	r.watchApprovals(ctx)
	for {
		select {
		case <-ctx.Done():
			return nil
		case u := <-r.tg.Updates():
			if u == nil || u.Message == nil {
				continue
			}
			// A turn is queued here, in arrival order (turn.go); every
			// other message in its own goroutine: a slow /logs must not
			// hold back a /stop.
			if r.isTurn(u.Message) {
				r.Handle(ctx, u.Message)
				continue
			}
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				r.Handle(ctx, u.Message)
			}()
		}
	}
}

// isTurn reports whether m is an owner's plain message in an agent's
// chat: Handle only queues it, without waiting.
func (r *Relay) isTurn(m *models.Message) bool {
	if m.From == nil || !r.owners[m.From.ID] || m.Document != nil || m.Text == "" || strings.HasPrefix(m.Text, "/") {
		return false
	}
	return r.agentFor(tg.Target{ChatID: m.Chat.ID, Topic: topicOf(m)}) != ""
}

// request is one message being handled.
type request struct {
	msg   *models.Message
	to    tg.Target // where the answer goes (the message's chat and topic)
	agent string    // "" when the chat is bound to no agent
	actor string
}

// Handle decides what one message is and carries it out.
func (r *Relay) Handle(ctx context.Context, m *models.Message) {
	q := &request{msg: m, to: tg.Target{ChatID: m.Chat.ID, Topic: topicOf(m)}, actor: actorOf(m.From)}
	q.agent = r.agentFor(q.to)
	if m.From == nil || !r.owners[m.From.ID] {
		r.refuseStranger(ctx, q)
		return
	}
	if m.Document != nil {
		c, _, _ := parseCommand(m.Caption, r.tg.Username)
		if q.agent == "" {
			r.answer(ctx, q, fmt.Sprintf("This chat (id %d, topic %d) is bound to no agent.", q.to.ChatID, q.to.Topic))
			r.audit(ctx, q, "upload", bus.RelayRefused, "chat bound to no agent")
			return
		}
		action, outcome, detail := r.handleDocument(ctx, q, c == "apply")
		r.audit(ctx, q, action, outcome, detail)
		return
	}
	cmd, args, isCmd := parseCommand(m.Text, r.tg.Username)
	if !isCmd && m.Text == "" {
		return // a photo, a sticker, a member joining: nothing to do
	}
	if cmd == "" && isCmd {
		return // a command addressed to another bot
	}
	if q.agent == "" {
		r.answer(ctx, q, fmt.Sprintf("This chat (id %d, topic %d) is bound to no agent. Add it to the relay block: chat \"AGENT\" { chat_id = %d }.", q.to.ChatID, q.to.Topic, q.to.ChatID))
		r.audit(ctx, q, actionName(cmd, isCmd), bus.RelayRefused, "chat bound to no agent")
		return
	}
	if !isCmd {
		r.enqueueTurn(ctx, q, m.Text)
		return
	}
	c, ok := commands[cmd]
	if !ok {
		r.answer(ctx, q, fmt.Sprintf("Unknown command /%s. /help lists them.", cmd))
		r.audit(ctx, q, cmd, bus.RelayRefused, "unknown command")
		return
	}
	outcome, detail := c.run(ctx, r, q, strings.TrimSpace(args))
	r.audit(ctx, q, cmd, outcome, detail)
}

func actionName(cmd string, isCmd bool) string {
	if !isCmd {
		return "turn"
	}
	return cmd
}

// agentFor finds the agent answering at t: its exact topic, else a whole
// chat binding (topic 0).
func (r *Relay) agentFor(t tg.Target) string {
	whole := ""
	for _, c := range r.doc.Chats {
		if c.ChatID != t.ChatID {
			continue
		}
		if int(c.Topic) == t.Topic && t.Topic != 0 {
			return c.Agent
		}
		if c.Topic == 0 {
			whole = c.Agent
		}
	}
	return whole
}

func topicOf(m *models.Message) int {
	if m.IsTopicMessage {
		return m.MessageThreadID
	}
	return 0
}

// actorOf names a chat user for the audit: the id (what owners are
// matched on) and, for reading, the @name (chosen by the user, so only
// shown, never trusted, and kept to one short line).
func actorOf(u *models.User) string {
	if u == nil {
		return "telegram:unknown"
	}
	s := fmt.Sprintf("telegram:%d", u.ID)
	if name := oneLine(u.Username, 32); name != "" {
		s += " (@" + name + ")"
	}
	return s
}

// oneLine keeps s to one line of at most n bytes of printable text.
func oneLine(s string, n int) string {
	var b strings.Builder
	for _, c := range s {
		if c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0) || c == 0x2028 || c == 0x2029 {
			c = ' '
		}
		if b.Len()+len(string(c)) > n {
			break
		}
		b.WriteRune(c)
	}
	return b.String()
}

// parseCommand splits "/cmd@bot args". A command for another bot gives
// ("", "", true); text that is no command gives ok false.
func parseCommand(text, botName string) (cmd, args string, ok bool) {
	if !strings.HasPrefix(text, "/") {
		return "", "", false
	}
	word, rest, _ := strings.Cut(text[1:], " ")
	if w, r, found := strings.Cut(word, "\n"); found {
		word, rest = w, r+" "+rest
	}
	word, target, addressed := strings.Cut(word, "@")
	if addressed && !strings.EqualFold(target, botName) {
		return "", "", true
	}
	return strings.ToLower(word), rest, true
}

// refuseStranger answers a non-owner (once per quiet period per chat) and
// audits every attempt.
func (r *Relay) refuseStranger(ctx context.Context, q *request) {
	var uid int64
	if q.msg.From != nil {
		uid = q.msg.From.ID
	}
	k := refusalKey{uid, q.to.ChatID}
	r.mu.Lock()
	last, seen := r.refused[k]
	tell := !seen || time.Since(last) > refusalQuiet
	if tell {
		if len(r.refused) > 10000 {
			r.refused = map[refusalKey]time.Time{}
		}
		r.refused[k] = time.Now()
	}
	r.mu.Unlock()
	what := "message"
	if cmd, _, ok := parseCommand(q.msg.Text, r.tg.Username); ok && cmd != "" {
		what = cmd
	}
	if tell {
		r.answer(ctx, q, "Refused: only the owners of this relay may use it. This attempt was recorded.")
	}
	r.audit(ctx, q, what, bus.RelayRefused, "not an owner")
}
