# want: 15:16 Relay account for another user
agent "alice" {
  command = ["/bin/true"]
}
agent "bob" {
  command = ["/bin/true"]
}
account "relay" {
  user = "alice"
  role = "operator"
}
relay {
  token_file = "/etc/nixcage/secrets/telegram"
  owners     = [42]
  account    = "relay"
  chat "alice" {
    chat_id = -100123
  }
}
