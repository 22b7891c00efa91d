// The status bar item: the current notebook's sandbox state and running cost; a click
// opens the Sandboxes panel.
import { Widget } from '@lumino/widgets';
import { call, dollars, ICurrent } from './api';

export const POLL_MS = 1500;

export class SandboxStatus extends Widget {
  private kernelId: string | null = null;
  private timer: number | null = null;

  constructor(private readonly onOpen: () => void) {
    super();
    this.addClass('jp-SandboxStatus');
    this.node.title = 'This notebook\'s sandbox: click for the Sandboxes panel';
    this.node.addEventListener('click', () => this.onOpen());
    this.timer = window.setInterval(() => void this.refresh(), POLL_MS);
  }

  /** The kernel of the notebook in focus (null: none, or not a notebook). */
  follow(kernelId: string | null): void {
    this.kernelId = kernelId;
    void this.refresh();
  }

  async refresh(): Promise<void> {
    const kernelId = this.kernelId;
    if (!kernelId) {
      this.show_('', null);
      return;
    }
    try {
      const current = await call<ICurrent>(`kernels/${encodeURIComponent(kernelId)}`);
      if (kernelId !== this.kernelId) {
        return; // the focus moved meanwhile
      }
      const sandbox = current.sandbox;
      this.show_(
        sandbox
          ? `Sandbox ${sandbox.name}: ${sandbox.status} · ${dollars(sandbox.cost_per_hour)}/h · ${dollars(sandbox.cost_so_far)} so far`
          : '',
        sandbox ? sandbox.status : null
      );
    } catch (error) {
      this.show_(`Sandbox: ${(error as Error).message}`, 'error');
    }
  }

  private show_(text: string, status: string | null): void {
    this.node.textContent = text;
    if (status) {
      this.node.dataset.status = status;
    } else {
      delete this.node.dataset.status;
    }
    this.setHidden(!text);
  }

  dispose(): void {
    if (this.timer !== null) {
      window.clearInterval(this.timer);
    }
    super.dispose();
  }
}
