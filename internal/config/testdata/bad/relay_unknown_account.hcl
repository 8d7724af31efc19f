# want: 16:16 Unknown relay account
agent "alice" {
  command = ["/bin/true"]
}
agent "bob" {
  command = ["/bin/true"]
}
account "relay" {
  user   = "cage-relay"
  role   = "operator"
  agents = ["alice"]
}
relay {
  token_file = "/etc/nixcage/secrets/telegram"
  owners     = [42]
  account    = "ghost"
  chat "alice" {
    chat_id = -100123
  }
}
