// The "Sandboxes" side panel: every sandbox of the user's engine or CreateOS account, with
// its actions, and the current notebook's network (egress rules and latest refusals).
import { Dialog, InputDialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import {
  call,
  dollars,
  ICurrent,
  IEgress,
  IListing,
  ISandbox,
  IUsage,
  sandboxPath
} from './api';

export const POLL_MS = 1500;

/** What the panel needs to know of the notebook in focus, and how to open a notebook. */
export interface INotebookFocus {
  kernelId(): string | null;
  kernelName(): string | null;
  directory(): string;
  open(path: string): void;
}

function element<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className = '',
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

const MIB = 1024 * 1024;

function describeUsage(usage: IUsage): string {
  const cpu = usage.cpu_percent === null ? 'CPU ?' : `CPU ${usage.cpu_percent.toFixed(0)}%`;
  const memory =
    usage.memory_used === null || usage.memory_total === null
      ? 'memory ?'
      : `memory ${(usage.memory_used / MIB).toFixed(0)} of ${(usage.memory_total / MIB).toFixed(0)} MiB`;
  return `now: ${cpu} · ${memory}`;
}

export class SandboxesPanel extends Widget {
  private readonly heading = element('div', 'jp-SandboxPanel-heading');
  private readonly error = element('div', 'jp-SandboxPanel-error');
  private readonly rows = element('div', 'jp-SandboxPanel-rows');
  private readonly network = element('div', 'jp-SandboxPanel-network');
  private readonly networkTitle = element('h3', '', "This notebook's network");
  private readonly rulesText = element('div', 'jp-SandboxPanel-rules');
  private readonly rulesInput = element('input', 'jp-SandboxPanel-rulesInput');
  private readonly refusals = element('div', 'jp-SandboxPanel-refusals');
  private timer: number | null = null;
  private current: string | null = null; // the focused notebook's sandbox id
  private usage: IUsage | null = null; // its CPU and memory now, as its kernel reports them
  private busy = false;
  private notice = ''; // the last action's note, shown until the next action

  constructor(private readonly focus: INotebookFocus) {
    super();
    this.id = 'sandbox-kernel-panel';
    this.addClass('jp-SandboxPanel');
    this.title.caption = 'Sandboxes';
    this.title.label = 'Sandboxes';

    const list = element('div', 'jp-SandboxPanel-list');
    list.appendChild(this.rows);

    this.rulesInput.placeholder = 'rules: example.com api.example.org:443 10.0.0.0/8 pypi';
    const save = this.button('Save rules', 'save-rules', () => this.saveRules());
    const blockAll = this.button('Block all', 'block-all', () =>
      this.putRules([], true)
    );
    const openAll = this.button('Allow all public', 'allow-all', () =>
      this.putRules([], false)
    );
    const editor = element('div', 'jp-SandboxPanel-editor');
    const editorButtons = element('div', 'jp-SandboxPanel-buttons');
    editorButtons.append(save, blockAll, openAll);
    editor.append(this.rulesInput, editorButtons);
    this.network.append(
      this.networkTitle,
      this.rulesText,
      editor,
      element('h4', '', 'Latest refusals'),
      this.refusals
    );
    this.node.append(this.heading, this.error, list, this.network);
  }

  protected onAfterShow(): void {
    void this.refresh();
    if (this.timer === null) {
      this.timer = window.setInterval(() => void this.refresh(), POLL_MS);
    }
  }

  protected onAfterHide(): void {
    if (this.timer !== null) {
      window.clearInterval(this.timer);
      this.timer = null;
    }
  }

  dispose(): void {
    this.onAfterHide();
    super.dispose();
  }

  async refresh(): Promise<void> {
    if (this.busy) {
      return; // an action is under way: its own refresh follows
    }
    try {
      const listing = await call<IListing>('sandboxes');
      const kernelId = this.focus.kernelId();
      const current = kernelId
        ? (await call<ICurrent>(`kernels/${encodeURIComponent(kernelId)}?usage=1`)).sandbox
        : null;
      this.current = current?.id ?? null;
      this.usage = current?.usage ?? null;
      this.render(listing);
      await this.renderNetwork();
    } catch (error) {
      // The listing's own trouble goes in the heading, and goes when it does; an action's
      // error stays below it until the next action.
      this.heading.textContent = `Sandboxes: ${(error as Error).message}`;
    }
  }

  private render(listing: IListing): void {
    this.heading.textContent =
      `${listing.sandboxes.length} sandbox(es) on ${listing.provider}` +
      (listing.note ? ` (${listing.note})` : '');
    this.rows.replaceChildren(...listing.sandboxes.map(s => this.row(s)));
  }

  /** One sandbox as a card: name and state; owner, age, shape; cost; its actions. */
  private row(sandbox: ISandbox): HTMLDivElement {
    const row = element('div', 'jp-SandboxPanel-row');
    row.dataset.sandboxId = sandbox.id;
    row.dataset.status = sandbox.status;
    const title = element('div', 'jp-SandboxPanel-title');
    const name = element('span', 'jp-SandboxPanel-name', sandbox.name);
    name.title = sandbox.id + (sandbox.forked_from ? `, forked from ${sandbox.forked_from}` : '');
    const state = element('span', 'jp-SandboxPanel-state', sandbox.status);
    state.dataset.status = sandbox.status;
    title.append(name, state);
    if (sandbox.id === this.current) {
      row.classList.add('jp-mod-current');
      title.appendChild(element('span', 'jp-SandboxPanel-here', 'this notebook'));
    }
    const owner = element('span', 'jp-SandboxPanel-owner', sandbox.owner.label);
    owner.dataset.kind = sandbox.owner.kind;
    owner.title = sandbox.driven_by.length
      ? `owner: ${sandbox.owner.label}; cells run from ${sandbox.driven_by.join(', ')}`
      : `owner: ${sandbox.owner.label}`;
    const facts = element('div', 'jp-SandboxPanel-facts');
    facts.append(
      owner,
      element('span', '', ` · ${sandbox.age} old · ${sandbox.shape}`)
    );
    const cost = element(
      'div',
      'jp-SandboxPanel-cost',
      `${dollars(sandbox.cost_per_hour)}/h now · ${dollars(sandbox.cost_so_far)} so far`
    );
    const actions = element('div', 'jp-SandboxPanel-buttons');
    if (sandbox.status === 'running') {
      actions.appendChild(this.button('Pause', 'pause', () => this.act(sandbox, 'pause')));
    } else if (sandbox.status === 'paused') {
      actions.appendChild(this.button('Resume', 'resume', () => this.act(sandbox, 'resume')));
    }
    const keep = this.button('Keep', 'keep', () => this.act(sandbox, 'keep'));
    keep.disabled = sandbox.owner.kind === 'kept' || sandbox.owner.kind === 'warm pool';
    keep.title = 'Let it outlive its notebook (gc leaves it)';
    actions.append(
      this.button('Fork', 'fork', () => this.fork(sandbox)),
      keep,
      this.button('Open in a new notebook', 'open', () => this.openNotebook(sandbox)),
      this.button('Destroy', 'destroy', () => this.destroy(sandbox))
    );
    row.append(title, facts, cost);
    if (sandbox.id === this.current && this.usage) {
      row.appendChild(element('div', 'jp-SandboxPanel-usage', describeUsage(this.usage)));
    }
    row.appendChild(actions);
    return row;
  }

  private button(label: string, action: string, run: () => Promise<void>): HTMLButtonElement {
    const button = element('button', 'jp-SandboxPanel-button', label);
    button.dataset.action = action;
    button.addEventListener('click', () => void this.run(run));
    return button;
  }

  /** One action at a time; its error is the panel's one line; then a fresh listing. */
  private async run(work: () => Promise<void>): Promise<void> {
    if (this.busy) {
      return;
    }
    this.busy = true;
    this.node.classList.add('jp-mod-busy');
    this.showError('');
    this.notice = '';
    try {
      await work();
    } catch (error) {
      this.showError((error as Error).message);
    } finally {
      this.busy = false;
      this.node.classList.remove('jp-mod-busy');
    }
    await this.refresh();
    if (this.notice && !this.error.textContent) {
      this.showError(this.notice);
    }
  }

  private async act(sandbox: ISandbox, action: string): Promise<void> {
    await call(sandboxPath(sandbox.id, action), 'POST', {});
  }

  private async fork(sandbox: ISandbox): Promise<void> {
    const answer = await InputDialog.getText({
      title: `Fork ${sandbox.name}`,
      label: 'Name of the fork (optional; lowercase letters, digits, -). ' +
        'The sandbox is paused first and stays paused until its notebook runs a cell.',
      placeholder: 'my-experiment',
      okLabel: 'Fork'
    });
    if (!answer.button.accept) {
      return;
    }
    await call(sandboxPath(sandbox.id, 'fork'), 'POST', { name: (answer.value || '').trim() });
  }

  private async destroy(sandbox: ISandbox): Promise<void> {
    const driven = sandbox.driven_by.length
      ? ` ${sandbox.driven_by.join(', ')} runs its cells there.`
      : '';
    const answer = await showDialog({
      title: `Destroy ${sandbox.name}?`,
      body: `Sandbox ${sandbox.id} and everything in it (files, variables) will be gone.${driven}`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Destroy' })]
    });
    if (answer.button.accept) {
      await call(sandboxPath(sandbox.id), 'DELETE');
    }
  }

  private async openNotebook(sandbox: ISandbox): Promise<void> {
    const opened = await call<{ path: string }>(sandboxPath(sandbox.id, 'open'), 'POST', {
      kernel_name: this.focus.kernelName() ?? '',
      directory: this.focus.directory()
    });
    this.focus.open(opened.path);
  }

  // -- the current notebook's network ---------------------------------------------------

  private async renderNetwork(): Promise<void> {
    const sandboxId = this.current;
    this.network.dataset.sandboxId = sandboxId ?? '';
    if (!sandboxId) {
      this.network.classList.add('jp-mod-hidden');
      return;
    }
    this.network.classList.remove('jp-mod-hidden');
    const egress = await call<IEgress>(sandboxPath(sandboxId, 'egress'));
    if (sandboxId !== this.current) {
      return;
    }
    this.rulesText.textContent = egress.block_all
      ? 'Rules: nothing (all outbound connections blocked)'
      : egress.rules.length
        ? `Rules: only ${egress.rules.join(', ')}`
        : 'Rules: all public destinations (no rules)';
    this.rulesText.dataset.rules = egress.rules.join(' ');
    if (egress.denied_count === null) {
      this.refusals.replaceChildren(
        this.note('this provider does not report refusals')
      );
      return;
    }
    this.refusals.replaceChildren(
      ...(egress.denied.length
        ? egress.denied.map(refusal => {
            const target = `${refusal.host}:${refusal.port}`;
            const item = element('div', 'jp-SandboxPanel-refusal');
            item.dataset.target = target;
            const line = element('div', 'jp-SandboxPanel-title');
            line.append(
              element('span', 'jp-SandboxPanel-name', target),
              this.button('Allow', 'allow', () => this.allow(sandboxId, target))
            );
            item.append(
              line,
              element(
                'div',
                'jp-SandboxPanel-facts',
                `${new Date(refusal.at).toLocaleTimeString()}: ${refusal.reason}`
              )
            );
            return item;
          })
        : [this.note('none')])
    );
  }

  private note(text: string): HTMLDivElement {
    return element('div', 'jp-SandboxPanel-none', text);
  }

  private async allow(sandboxId: string, target: string): Promise<void> {
    const egress = await call<IEgress>(sandboxPath(sandboxId, 'egress', 'allow'), 'POST', {
      target
    });
    this.notice = egress.note ?? '';
  }

  private async saveRules(): Promise<void> {
    const rules = this.rulesInput.value.split(/[\s,]+/).filter(rule => rule);
    if (!rules.length) {
      throw new Error('type one or more rules, or use Block all / Allow all public');
    }
    await this.putRules(rules, false);
    this.rulesInput.value = '';
  }

  private async putRules(rules: string[], blockAll: boolean): Promise<void> {
    if (!this.current) {
      throw new Error('the notebook in focus drives no sandbox');
    }
    // The server extension validates the rules as %egress does.
    await call(sandboxPath(this.current, 'egress'), 'PUT', blockAll ? { block_all: true } : { rules });
  }

  private showError(message: string): void {
    this.error.textContent = message;
    this.error.classList.toggle('jp-mod-hidden', !message);
  }
}
