package relay

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"time"

	"github.com/nixcage/nixcage/internal/relay/tg"
)

// answer posts text: split at Telegram's limit, or as a file when that
// would take more than MaxAnswerMessages messages.
func (r *Relay) answer(ctx context.Context, q *request, text string) {
	r.answerNamed(ctx, q, text, "answer.txt")
}

func (r *Relay) answerNamed(ctx context.Context, q *request, text, file string) {
	if text == "" {
		text = "(empty)"
	}
	parts := tg.Split(text, tg.MaxMessage)
	if len(parts) > MaxAnswerMessages {
		caption := fmt.Sprintf("%d characters, more than %d messages: sent as a file", len([]rune(text)), MaxAnswerMessages)
		data := []byte(text)
		if err := r.tg.SendDocument(ctx, q.to, file, caption, func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(data)), nil
		}); err != nil {
			r.log.Warn("send answer as a file", "chat", q.to.ChatID, "err", err)
		}
		return
	}
	for _, p := range parts {
		if err := r.tg.SendText(ctx, q.to, p); err != nil {
			r.log.Warn("send answer", "chat", q.to.ChatID, "err", err)
			return
		}
	}
}

// typing shows "typing…" in q's chat until stop is closed.
func (r *Relay) typing(ctx context.Context, q *request, stop <-chan struct{}) {
	every := r.TypingEvery
	if every <= 0 {
		every = DefaultTypingEvery
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if err := r.tg.Typing(ctx, q.to); err != nil {
			r.log.Debug("typing", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-stop:
			return
		case <-t.C:
		}
	}
}
