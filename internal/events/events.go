// Package events writes caged's events to the systemd journal as structured
// entries, one fixed MESSAGE_ID per kind, so journald-based log shippers
// (journalbeat, Vector, Fluent Bit, promtail, systemd-journal-upload) can
// select and parse them with no nixcage code on the collector side. The
// table below is the one source of those ids; docs/fleet.md lists it and a
// test keeps the two in step.
package events

import (
	"fmt"
	"strings"

	"github.com/coreos/go-systemd/v22/journal"

	"github.com/nixcage/nixcage/internal/bus"
)

// Kind is one kind of event.
type Kind struct {
	// Name is the value of the NIXCAGE_EVENT field.
	Name string
	// ID is the journal MESSAGE_ID: 128 bits, generated once, never changed
	// (a shipper's filter depends on it).
	ID string
	// Signal is the bus signal the event mirrors ("" for none).
	Signal string
	// Fields name the signal's arguments, in order, as journal fields.
	Fields   []string
	Priority journal.Priority
	// Message renders MESSAGE from the fields.
	Message func(f map[string]string) string
}

// The kinds. Ids were made with uuid4 once; never reuse or change one.
var (
	AgentStateChanged = Kind{Name: "agent-state", ID: "18756bec5f8e43699219104c1a816ce0", Signal: bus.SignalAgentStateChanged,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_ACTIVE_STATE", "NIXCAGE_SUB_STATE"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s is %s (%s)", f["NIXCAGE_AGENT"], f["NIXCAGE_ACTIVE_STATE"], f["NIXCAGE_SUB_STATE"])
		}}
	ReleaseApplied = Kind{Name: "release-applied", ID: "00073163b18b4eaab074c3c47bc3d4d7", Signal: bus.SignalReleaseApplied,
		Fields: []string{"NIXCAGE_GENERATION", "NIXCAGE_PREVIOUS_GENERATION", "NIXCAGE_BY"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("store generation %s is current (was %s), by %s", f["NIXCAGE_GENERATION"], f["NIXCAGE_PREVIOUS_GENERATION"], f["NIXCAGE_BY"])
		}}
	ReleaseRefused = Kind{Name: "release-refused", ID: "bf6244cf6d00442ca0019db88f963f9b",
		Fields: []string{"NIXCAGE_OP", "NIXCAGE_SOURCE", "NIXCAGE_BY", "NIXCAGE_REASON"}, Priority: journal.PriErr,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("release refused (%s %s, by %s): %s", f["NIXCAGE_OP"], f["NIXCAGE_SOURCE"], f["NIXCAGE_BY"], f["NIXCAGE_REASON"])
		}}
	AgentQuarantined = Kind{Name: "agent-quarantined", ID: "d11e6dedbe194fc3bff3e2a469754401", Signal: bus.SignalAgentQuarantined,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_REASON", "NIXCAGE_EVIDENCE", "NIXCAGE_BY"}, Priority: journal.PriWarning,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s quarantined by %s: %s (evidence %s)", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"], f["NIXCAGE_REASON"], f["NIXCAGE_EVIDENCE"])
		}}
	AgentReleased = Kind{Name: "agent-released", ID: "fbd147f9bf454585b2e5c98393bda7d7", Signal: bus.SignalAgentReleased,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BY"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s released from quarantine by %s", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"])
		}}
	AgentKilled = Kind{Name: "agent-killed", ID: "d721aaf189c44784afba99afe7c3ad13", Signal: bus.SignalAgentKilled,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BY"}, Priority: journal.PriWarning,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s killed by %s", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"])
		}}
	EgressFailed = Kind{Name: "egress-failed", ID: "291839dbbbae4ed5a7a0fa24ab03a950", Signal: bus.SignalEgressFailed,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_REASON", "NIXCAGE_RECOVER"}, Priority: journal.PriErr,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s has no network: %s; recover with %s", f["NIXCAGE_AGENT"], f["NIXCAGE_REASON"], f["NIXCAGE_RECOVER"])
		}}
	RunStarted = Kind{Name: "run-started", ID: "32971e7823bf4601b0b28630d4a7b41a", Signal: bus.SignalRunStarted,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BACKEND", "NIXCAGE_BY"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("throw-away cage %s started (%s) by %s", f["NIXCAGE_AGENT"], f["NIXCAGE_BACKEND"], f["NIXCAGE_BY"])
		}}
	RunFinished = Kind{Name: "run-finished", ID: "89e99b72c21d49c48e97966d9e3d2625", Signal: bus.SignalRunFinished,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_EXIT_STATUS", "NIXCAGE_SUMMARY"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("throw-away cage %s finished with exit status %s", f["NIXCAGE_AGENT"], f["NIXCAGE_EXIT_STATUS"])
		}}
	// ControlCommand is every attempt to execute a signed control command
	// (docs/fleet.md, "Acknowledgements"): the ack, as a journal entry.
	ControlCommand = Kind{Name: "control-command", ID: "a04a4006698744969cd7c45ba1fc5927",
		Fields:   []string{"NIXCAGE_STATUS", "NIXCAGE_ACTION", "NIXCAGE_AGENT", "NIXCAGE_BAN", "NIXCAGE_COMMAND", "NIXCAGE_NONCE", "NIXCAGE_HOST_ID", "NIXCAGE_SOURCE", "NIXCAGE_BY", "NIXCAGE_REASON"},
		Priority: journal.PriWarning,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("control command %s (%s %s) %s: %s", short(f["NIXCAGE_COMMAND"]), f["NIXCAGE_ACTION"], f["NIXCAGE_AGENT"], f["NIXCAGE_STATUS"], f["NIXCAGE_REASON"])
		}}
	ShellOpened = Kind{Name: "shell-opened", ID: "8d4c719d470640b58d43a5f01b617396", Signal: bus.SignalShellOpened,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BY", "NIXCAGE_COMMAND", "NIXCAGE_UNIT"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("shell opened in agent %s by %s: %s (unit %s)", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"], f["NIXCAGE_COMMAND"], f["NIXCAGE_UNIT"])
		}}
	ShellClosed = Kind{Name: "shell-closed", ID: "cd64b66cc8f14dcf9e34f0fe2d104c18", Signal: bus.SignalShellClosed,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BY", "NIXCAGE_EXIT_STATUS", "NIXCAGE_UNIT"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("shell in agent %s by %s ended with exit status %s (unit %s)", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"], f["NIXCAGE_EXIT_STATUS"], f["NIXCAGE_UNIT"])
		}}
	RelayAction = Kind{Name: "relay-action", ID: "cd5ded8a21284dddaecf6d5b615730f5", Signal: bus.SignalRelayAction,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_ACTOR", "NIXCAGE_ACTION", "NIXCAGE_OUTCOME", "NIXCAGE_DETAIL", "NIXCAGE_BY"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			agent := f["NIXCAGE_AGENT"]
			if agent == "" {
				agent = "(no agent)"
			}
			return fmt.Sprintf("relay %s: %s %s on %s: %s", f["NIXCAGE_OUTCOME"], f["NIXCAGE_ACTOR"], f["NIXCAGE_ACTION"], agent, f["NIXCAGE_DETAIL"])
		}}
	LearnStarted = Kind{Name: "learn-started", ID: "28e2b179dd7f4467bcaec015d51ff676",
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_UNTIL"}, Priority: journal.PriWarning,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s is in LEARN MODE until %s: requests outside its policy are allowed and flagged (audit rule learn)", f["NIXCAGE_AGENT"], f["NIXCAGE_UNTIL"])
		}}
	LearnEnded = Kind{Name: "learn-ended", ID: "ca6684ddd5574af6955d523549b7b0ff",
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_UNTIL"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s: learn mode ended at %s; its policy applies again", f["NIXCAGE_AGENT"], f["NIXCAGE_UNTIL"])
		}}
	ApprovalPending = Kind{Name: "approval-pending", ID: "8d00a7ad6c0d4f1b9afbfdc6634df75f", Signal: bus.SignalApprovalPending,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_APPROVAL", "NIXCAGE_HOST", "NIXCAGE_PORT", "NIXCAGE_METHOD", "NIXCAGE_PATH", "NIXCAGE_SINCE", "NIXCAGE_EXPIRES"}, Priority: journal.PriWarning,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s asks to reach %s:%s (%s %s); approve with cagectl approve %s once|host|deny", f["NIXCAGE_AGENT"], f["NIXCAGE_HOST"], f["NIXCAGE_PORT"], f["NIXCAGE_METHOD"], f["NIXCAGE_PATH"], f["NIXCAGE_APPROVAL"])
		}}
	ApprovalDecided = Kind{Name: "approval-decided", ID: "79c49735575b4f6b8ccb5c9f225da78c", Signal: bus.SignalApprovalDecided,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_APPROVAL", "NIXCAGE_VERDICT", "NIXCAGE_BY"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("agent %s: approval %s decided %s by %s", f["NIXCAGE_AGENT"], f["NIXCAGE_APPROVAL"], f["NIXCAGE_VERDICT"], f["NIXCAGE_BY"])
		}}
	Reconciled = Kind{Name: "reconciled", ID: "04bff51dea2f4fe6b77ab30df1d0ecda", Signal: bus.SignalReconciled,
		Fields: []string{"NIXCAGE_ERROR"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			if e := f["NIXCAGE_ERROR"]; e != "" {
				return "reconcile failed: " + e
			}
			return "configuration reconciled"
		}}
)

// ChannelPollFailed is a poll of the release channel that failed for a
// reason other than a refused release (which is ReleaseRefused): the
// server unreachable, a malformed index, a fetch over its limits. Written
// once per distinct reason, not per retry.
var ChannelPollFailed = Kind{Name: "channel-poll-failed", ID: "e04187dfb441445cad12deb101262e5d",
	Fields: []string{"NIXCAGE_URL", "NIXCAGE_REASON"}, Priority: journal.PriWarning,
	Message: func(f map[string]string) string {
		return fmt.Sprintf("release channel %s: poll failed: %s", f["NIXCAGE_URL"], f["NIXCAGE_REASON"])
	}}

// Turns and workspace files (docs/relay.md): who asked what of which
// agent, and the outcome; never the text, the reply or a file's bytes.
var (
	TurnStarted = Kind{Name: "turn-started", ID: "3b49cb6a47a64ebea82503cd72e25ac2", Signal: bus.SignalTurnStarted,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BY"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("turn of agent %s started by %s", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"])
		}}
	TurnFinished = Kind{Name: "turn-finished", ID: "3adccbe848e34b7ba1487fc646e94c5a", Signal: bus.SignalTurnFinished,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_BY", "NIXCAGE_STATUS", "NIXCAGE_EXIT_STATUS", "NIXCAGE_DURATION_MS"}, Priority: journal.PriInfo,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("turn of agent %s by %s: %s (exit status %s, %s ms)", f["NIXCAGE_AGENT"], f["NIXCAGE_BY"], f["NIXCAGE_STATUS"], f["NIXCAGE_EXIT_STATUS"], f["NIXCAGE_DURATION_MS"])
		}}
	FileTransferred = Kind{Name: "file-transferred", ID: "d8c28ca8cb2543d2a5947402bd5bbad1", Signal: bus.SignalFileTransferred,
		Fields: []string{"NIXCAGE_AGENT", "NIXCAGE_OP", "NIXCAGE_PATH", "NIXCAGE_BYTES", "NIXCAGE_OUTCOME", "NIXCAGE_BY"}, Priority: journal.PriNotice,
		Message: func(f map[string]string) string {
			return fmt.Sprintf("%s %s of agent %s by %s: %s (%s bytes)", f["NIXCAGE_OP"], f["NIXCAGE_PATH"], f["NIXCAGE_AGENT"], f["NIXCAGE_BY"], f["NIXCAGE_OUTCOME"], f["NIXCAGE_BYTES"])
		}}
)

// Kinds is every kind, in the order docs/fleet.md lists them.
var Kinds = []Kind{AgentStateChanged, ReleaseApplied, ReleaseRefused, AgentQuarantined, AgentReleased, AgentKilled, EgressFailed, RunStarted, RunFinished, ShellOpened, ShellClosed, RelayAction, Reconciled, ChannelPollFailed, LearnStarted, LearnEnded, ApprovalPending, ApprovalDecided,
	TurnStarted, TurnFinished, FileTransferred, ControlCommand}

func short(s string) string {
	if len(s) > 16 {
		return s[:16]
	}
	return s
}

// Identifier is SYSLOG_IDENTIFIER of every event.
const Identifier = "caged"

// ForSignal is the kind mirroring a bus signal, if any. Egress decisions
// have none on purpose: the gateway's audit log is their record, and one
// journal entry per request would let a cage flood the journal.
func ForSignal(signal string) (Kind, bool) {
	for _, k := range Kinds {
		if k.Signal != "" && k.Signal == signal {
			return k, true
		}
	}
	return Kind{}, false
}

// Fields pairs k's field names with args (a signal's arguments).
func (k Kind) FieldsOf(args ...any) map[string]string {
	f := make(map[string]string, len(k.Fields))
	for i, name := range k.Fields {
		if i < len(args) {
			f[name] = fmt.Sprint(args[i])
		}
	}
	return f
}

// Entry is the journal entry of an event: MESSAGE, PRIORITY and the fields.
func (k Kind) Entry(f map[string]string) (string, journal.Priority, map[string]string) {
	vars := make(map[string]string, len(f)+3)
	for n, v := range f {
		vars[n] = v
	}
	vars["MESSAGE_ID"] = k.ID
	vars["NIXCAGE_EVENT"] = k.Name
	vars["SYSLOG_IDENTIFIER"] = Identifier
	// MESSAGE is one line whatever an agent put into a reason.
	msg := strings.NewReplacer("\n", `\n`, "\r", `\r`).Replace(k.Message(f))
	return msg, k.Priority, vars
}

// Send writes the event to the journal. Without a journal (not under
// systemd: tests, a foreground caged) it does nothing: the bus signal and
// caged's log line still carry the event.
func Send(k Kind, f map[string]string) error {
	if !journal.Enabled() {
		return nil
	}
	msg, pri, vars := k.Entry(f)
	if err := journal.Send(msg, pri, vars); err != nil {
		return fmt.Errorf("journal event %s: %w", k.Name, err)
	}
	return nil
}
