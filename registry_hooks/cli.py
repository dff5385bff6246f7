"""`promote`: placeholder until the promotion sync lands (issue 5); it refuses instead of pretending."""
import click


@click.group(invoke_without_command=True)
@click.pass_context
def main(ctx: click.Context) -> None:
    """Promote registered adapter versions to served aliases (not implemented yet)."""
    raise click.ClickException("promote is not implemented yet (see issue 5); nothing was changed")
