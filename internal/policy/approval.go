package policy

import "time"

// Approval queue bounds: one default per knob, set here.
const (
	// DefaultApprovalWait is how long a request outside the policy waits
	// for an operator without approval.wait; MaxApprovalWait the longest
	// the config accepts (the agent's connection is held open meanwhile).
	DefaultApprovalWait = 30 * time.Second
	MaxApprovalWait     = 5 * time.Minute
	// DefaultMaxPending distinct requests wait at once per agent; more
	// are refused at once (rule approval-queue-full). MaxMaxPending is
	// the largest max_pending the config accepts.
	DefaultMaxPending = 4
	MaxMaxPending     = 32
)
