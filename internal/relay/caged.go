package relay

import (
	"context"
	"os"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
)

// Caged is what the relay asks of caged: methods of the typed bus client
// (*bus.Client), each authorized by caged against the relay's account.
type Caged interface {
	Status(ctx context.Context) (*bus.Status, error)
	Start(ctx context.Context, agent string) error
	Stop(ctx context.Context, agent string) error
	Kill(ctx context.Context, agent string) error
	Quarantine(ctx context.Context, agent, reason string) (string, error)
	ReadLogs(ctx context.Context, agent string, lines uint32, cursor string) ([]string, string, error)
	ReadAudit(ctx context.Context, agent string, offset int64, max uint32) ([]string, int64, error)
	ApplyDir(ctx context.Context, dir *os.File) (*bus.ApplyResult, error)
	AllowHost(ctx context.Context, agent, host string, port int, d time.Duration, reason string) (*bus.Grant, error)
	ListGrants(ctx context.Context, agent string) ([]bus.Grant, error)
	ListApprovals(ctx context.Context, agent string) ([]bus.Approval, error)
	Decide(ctx context.Context, id, verdict string) (string, error)
	RecordRelayAction(ctx context.Context, a bus.RelayAction) error
	// Events is caged's signal stream (the relay posts ApprovalPending).
	Events(ctx context.Context) (<-chan bus.Event, error)
	// Turns and workspace files, caged's side (docs/relay.md).
	Turn(ctx context.Context, agent, text string) (bus.TurnResult, error)
	GetFile(ctx context.Context, agent, path string, maxBytes uint64) (*os.File, uint64, error)
	PutFile(ctx context.Context, agent, name string, f *os.File) (string, error)
}
