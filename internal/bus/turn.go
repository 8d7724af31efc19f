package bus

import (
	"context"
	"errors"
	"os"

	"github.com/godbus/dbus/v5"
)

// Turns and workspace files (docs/relay.md, "Caged side"): what a chat
// relay, or cagectl say/get/put, asks of one agent. Each needs role
// operator over the agent: a turn makes the agent act, a file put into its
// workspace is input to it.

// Signals about turns and files. They name who asked and the outcome, never
// the text, the reply or a file's contents; like the egress signals they are
// addressed to subscribers allowed to view the agent, never broadcast.
const (
	SignalTurnStarted     = "TurnStarted"     // (s agent, s by)
	SignalTurnFinished    = "TurnFinished"    // (s agent, s by, s status, i exit_status, t duration_ms)
	SignalFileTransferred = "FileTransferred" // (s agent, s op, s path, t bytes, s outcome, s by)
)

// ErrorBusy: the agent's turn queue is full.
const ErrorBusy = "org.nixcage.cage1.Error.Busy"

// ErrBusy marks a full turn queue: a backend wraps it, the server sends
// ErrorBusy, a client's RemoteError matches it again.
var ErrBusy = errors.New("agent is busy")

// Limits of turns and file transfers; docs/relay.md states them.
const (
	// MaxTurnText bounds the text of one turn (a chat message is at most
	// 4096 characters).
	MaxTurnText = 64 << 10
	// MaxTurnReply bounds the reply returned; longer output is cut.
	MaxTurnReply = 1 << 20
	// MaxQueuedTurns is how many turns may wait behind the running one.
	MaxQueuedTurns = 8
	// MaxFileBytes is the largest file GetFile returns or PutFile saves
	// (Telegram's own limit for files bots send).
	MaxFileBytes = 50 << 20
)

// Turn statuses.
const (
	TurnSuccess  = "success"  // exit 0
	TurnFailed   = "failed"   // non-zero exit or a signal
	TurnTimeout  = "timeout"  // stopped at turn_timeout
	TurnCanceled = "canceled" // the caller left, the agent was quarantined or killed, caged stopped
	// TurnRefused appears only in TurnFinished events: the call got an
	// error (busy, quarantined, no turn command) and nothing ran.
	TurnRefused = "refused"
)

// Exit statuses of turns that did not end by themselves.
const (
	ExitTimeout  = 124 // as timeout(1)
	ExitCanceled = 125
)

// TurnResult is what one turn returned. Wire order: (ssi) as the method's
// three out arguments.
type TurnResult struct {
	Reply  string `json:"reply"`
	Status string `json:"status"`
	Exit   int32  `json:"exit_status"`
}

// File operations in FileTransferred.
const (
	FileGet = "get"
	FilePut = "put"
)

// TurnBackend is what caged implements for turns and files. The server has
// authorized the caller (operator, agent in scope) before calling. ctx ends
// when the caller leaves the bus.
type TurnBackend interface {
	Turn(ctx context.Context, agent, text, by string) (TurnResult, error)
	// GetFile returns a sealed copy of the file (the server closes it once
	// the reply is out) and its size.
	GetFile(ctx context.Context, agent, path string, maxBytes uint64, by string) (*os.File, uint64, error)
	// PutFile owns f.
	PutFile(ctx context.Context, agent, name string, f *os.File, by string) (string, error)
}

func (s *Server) turnBackend() (TurnBackend, *dbus.Error) {
	tb, ok := s.be.(TurnBackend)
	if !ok {
		return nil, newError(ErrorFailed, "this caged runs no turns")
	}
	return tb, nil
}

// TurnAgent runs one turn of the agent's harness in its cage and returns
// the reply. It returns when the turn ended (or was queued and then ran).
func (m *manager) TurnAgent(sender dbus.Sender, name, text string) (string, string, int32, *dbus.Error) {
	tb, derr := m.s.turnBackend()
	if derr != nil {
		return "", "", 0, derr
	}
	id, derr := m.s.authorizeAgent(sender, ActOperate, name, "TurnAgent")
	if derr != nil {
		return "", "", 0, derr
	}
	ctx, cancel := m.s.callerContext(sender)
	defer cancel()
	res, err := tb.Turn(ctx, name, text, id.String())
	if err != nil {
		return "", "", 0, fail(err)
	}
	return res.Reply, res.Status, res.Exit, nil
}

// GetAgentFile returns a read-only snapshot of a regular file in the
// agent's workspace and its size.
func (m *manager) GetAgentFile(sender dbus.Sender, name, path string, maxBytes uint64) (dbus.UnixFD, uint64, *dbus.Error) {
	tb, derr := m.s.turnBackend()
	if derr != nil {
		return -1, 0, derr
	}
	id, derr := m.s.authorizeAgent(sender, ActOperate, name, "GetAgentFile")
	if derr != nil {
		return -1, 0, derr
	}
	ctx, cancel := m.s.callerContext(sender)
	defer cancel()
	f, size, err := tb.GetFile(ctx, name, path, maxBytes, id.String())
	if err != nil {
		return -1, 0, fail(err)
	}
	go holdUntilSent(f)
	return dbus.UnixFD(f.Fd()), size, nil
}

// PutAgentFile saves the caller's file into the agent's workspace inbox.
func (m *manager) PutAgentFile(sender dbus.Sender, agent, name string, fd dbus.UnixFD) (string, *dbus.Error) {
	f := os.NewFile(uintptr(fd), "put "+name)
	tb, derr := m.s.turnBackend()
	if derr != nil {
		f.Close()
		return "", derr
	}
	id, derr := m.s.authorizeAgent(sender, ActOperate, agent, "PutAgentFile")
	if derr != nil {
		f.Close()
		return "", derr
	}
	ctx, cancel := m.s.callerContext(sender)
	defer cancel()
	saved, err := tb.PutFile(ctx, agent, name, f, id.String())
	return saved, fail(err)
}

func (o *agentObject) Turn(sender dbus.Sender, text string) (string, string, int32, *dbus.Error) {
	return (&manager{o.s}).TurnAgent(sender, o.name, text)
}

func (o *agentObject) GetFile(sender dbus.Sender, path string, maxBytes uint64) (dbus.UnixFD, uint64, *dbus.Error) {
	return (&manager{o.s}).GetAgentFile(sender, o.name, path, maxBytes)
}

func (o *agentObject) PutFile(sender dbus.Sender, name string, fd dbus.UnixFD) (string, *dbus.Error) {
	return (&manager{o.s}).PutAgentFile(sender, o.name, name, fd)
}

// Turn runs one turn of agent with text. It waits as long as the turn (and
// the queue before it) takes; ctx bounds the wait, and ending it leaves the
// bus call (caged cancels the turn when the caller's connection closes).
func (c *Client) Turn(ctx context.Context, agent, text string) (TurnResult, error) {
	var r TurnResult
	err := c.call(ctx, "TurnAgent", []any{&r.Reply, &r.Status, &r.Exit}, agent, text)
	return r, err
}

// GetFile returns a read-only snapshot of a file in agent's workspace (path
// relative to it) and its size; maxBytes 0 means MaxFileBytes.
func (c *Client) GetFile(ctx context.Context, agent, path string, maxBytes uint64) (*os.File, uint64, error) {
	var fd dbus.UnixFD
	var size uint64
	if err := c.call(ctx, "GetAgentFile", []any{&fd, &size}, agent, path, maxBytes); err != nil {
		return nil, 0, err
	}
	return os.NewFile(uintptr(fd), agent+":"+path), size, nil
}

// PutFile saves f (a regular file or memfd, read from offset 0) as
// inbox/name in agent's workspace and returns the path the agent sees.
func (c *Client) PutFile(ctx context.Context, agent, name string, f *os.File) (string, error) {
	var saved string
	err := c.call(ctx, "PutAgentFile", []any{&saved}, agent, name, FD(f))
	return saved, err
}
